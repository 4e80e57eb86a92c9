"""Build the policy model and its tokenizer from a config (``cfg.model``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from retrojax.agent.chat import ByteChatTokenizer


class ByteTokenizer(ByteChatTokenizer):
    """The agent loop's byte-level chat tokenizer plus the byte table the sampler's stop strings need
    (for tiny configs without a tokenizer directory)."""

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        return [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]


def build_model(cfg: Any) -> Any:
    """The policy of ``cfg.model``: a local HF checkpoint, or a freshly initialized preset."""
    from retrojax.model import PRESETS, Qwen3

    dtype = jnp.dtype(cfg.model.dtype)
    if cfg.model.path:
        from retrojax.model.checkpoint import from_pretrained

        return from_pretrained(cfg.model.path, dtype=dtype)
    if cfg.model.preset not in PRESETS:
        raise ValueError(f"model.preset {cfg.model.preset!r} is not one of {sorted(PRESETS)}")
    return Qwen3(PRESETS[cfg.model.preset], dtype=dtype, rngs=nnx.Rngs(cfg.model.seed),
                 remat=cfg.learn.remat)


def build_tokenizer(cfg: Any) -> Any:
    """``model.tokenizer`` (or the checkpoint directory); the byte-level tokenizer when neither is set."""
    path = cfg.model.tokenizer or cfg.model.path
    if not path:
        return ByteTokenizer()
    from retrojax.model.tokenizer import load_tokenizer

    return load_tokenizer(path)
