"""A small sentencepiece tokenizer trained here behaves like the Qwen3 one behind ChatTokenizer."""

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from retrojax.model import CHAT_SPECIAL_TOKENS, ChatTokenizer, load_tokenizer, train_sentencepiece


def _corpus(n=400, seed=0):
    rng = random.Random(seed)
    words = ("push box wall goal player move up down left right the a is to you board reveal cell mine flag "
             "<action> </action> <remark> </remark> # @ $ . _ 1 2 3").split()
    return ["".join(rng.choice(words) + rng.choice([" ", " ", "\n"]) for _ in range(40)) for _ in range(n)]


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory) -> ChatTokenizer:
    return train_sentencepiece(_corpus(), 600, tmp_path_factory.mktemp("spm"))


def test_trained_vocab_and_special_tokens(spm_tok):
    assert 300 <= spm_tok.vocab_size <= 600
    for token in CHAT_SPECIAL_TOKENS:
        assert len(spm_tok.encode(token)) == 1
    assert spm_tok.stop_token_ids == (spm_tok.im_end_id, spm_tok.endoftext_id)
    assert len(set(spm_tok.stop_token_ids)) == 2
    # words of the corpus become multi-character pieces, not one id per character
    assert len(spm_tok.encode("push the box left")) < len("push the box left") // 2
    assert len(spm_tok.generation_prompt()) <= 10


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
@example(text="a\u2581b \u2581\n")  # sentencepiece's own space marker, used as a plain character
def test_roundtrip_any_text(spm_tok, text):
    """Byte fallback: any text encodes and decodes back exactly, and token bytes add up to it."""
    ids = spm_tok.encode(text)
    assert spm_tok.decode(ids) == text
    table = spm_tok.token_bytes(spm_tok.vocab_size)
    assert b"".join(table[i] for i in ids) == text.encode()


def test_chat_format_same_text_as_qwen(spm_tok):
    chat = [{"role": "system", "content": "Play."}, {"role": "user", "content": "#@$.#\nmove?"},
            {"role": "assistant", "content": "<action>up</action>"}, {"role": "user", "content": "again"}]
    ids = spm_tok.encode_chat(chat)
    expected = ("<|im_start|>system\nPlay.<|im_end|>\n<|im_start|>user\n#@$.#\nmove?<|im_end|>\n"
                "<|im_start|>assistant\n<action>up</action><|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert spm_tok.decode(ids) == expected
    assert ids == spm_tok.encode(expected)
    turnwise = []
    for m in chat:
        turnwise = spm_tok.append_turn(turnwise, m["role"], m["content"])
    assert turnwise + spm_tok.generation_prompt() == ids
    assert spm_tok.decode(ids, skip_special_tokens=True).startswith("system\nPlay.\nuser")


def test_save_load_and_padded_vocab(spm_tok, tmp_path):
    spm_tok.save(tmp_path / "copy")
    loaded = load_tokenizer(tmp_path / "copy")
    text = "<|im_start|>user\npush box<|im_end|>\n"
    assert loaded.encode(text) == spm_tok.encode(text)
    assert loaded.vocab_size == spm_tok.vocab_size
    table = loaded.token_bytes(1024)
    assert len(table) == 1024 and table[-1] == b""


def test_training_is_deterministic(spm_tok, tmp_path):
    again = train_sentencepiece(_corpus(), 600, tmp_path)
    assert again.encode("push the box\nleft") == spm_tok.encode("push the box\nleft")


def test_bad_training_inputs(tmp_path):
    with pytest.raises(ValueError, match="non-empty"):
        train_sentencepiece(["", None], 500, tmp_path)
    with pytest.raises(ValueError, match="300"):
        train_sentencepiece(_corpus(10), 100, tmp_path)
