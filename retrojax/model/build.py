"""Build the policy model and its tokenizer from a config (``cfg.model``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from retrojax.model.tokenizer import ByteChatTokenizer


class ByteTokenizer(ByteChatTokenizer):
    """The agent loop's byte-level chat tokenizer plus the byte table the sampler's stop strings need
    (for tiny configs without a tokenizer directory)."""

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        return [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]


def build_model(cfg: Any, remat: bool | None = None) -> Any:
    """The policy of ``cfg.model``: a local HF checkpoint, or a freshly initialized preset; with
    ``model.adapter`` a PEFT LoRA adapter on it, else with ``learn.lora.rank > 0`` fresh LoRA adapters
    (retrojax.model.lora). ``remat``: rematerialize layers in the backward pass, decided by the caller
    (``learn.remat: auto`` is resolved by retrojax.plan.runtime.resolve_remat); None takes ``learn.remat``
    when it is a bool, else off.

    On more than one device the weights are created (or read) directly into their train-profile
    shardings on the ``cfg.mesh`` mesh: no device ever holds the whole model first.
    """
    if remat is None:
        setting = getattr(cfg.learn, "remat", False)
        remat = setting if isinstance(setting, bool) else False
    model = _build_base(cfg, remat)
    model.attention = getattr(cfg.model, "attention", "auto")  # model.attention (Qwen3.hidden's attention)
    model.layer_copies = getattr(cfg.sampler, "layer_copies", "auto")  # what samplers over it decode with
    lora = getattr(cfg.learn, "lora", None)
    adapter = getattr(cfg.model, "adapter", None)
    if adapter:
        from retrojax.model.peft import load_peft_adapter

        return load_peft_adapter(model, adapter, dtype=jnp.dtype(lora.dtype if lora else "float32"))
    if lora is not None and lora.rank > 0:
        from retrojax.model.lora import apply_lora

        return apply_lora(model, rank=lora.rank, alpha=lora.alpha, targets=lora.targets, dropout=lora.dropout,
                          dtype=jnp.dtype(lora.dtype), seed=cfg.model.seed)
    return model


def _build_base(cfg: Any, remat: bool) -> Any:
    from retrojax.model import PRESETS, Qwen3

    dtype = jnp.dtype(cfg.model.dtype)
    from retrojax.parallel.mesh import config_mesh

    mesh = config_mesh(cfg)
    if cfg.model.path:
        from retrojax.model.checkpoint import from_pretrained

        rules = None if mesh is None else _rules(cfg)
        model = from_pretrained(cfg.model.path, dtype=dtype, mesh=mesh,
                                **({} if rules is None else {"rules": rules}))
        model.remat = remat
        return model
    if cfg.model.preset not in PRESETS:
        raise ValueError(f"model.preset {cfg.model.preset!r} is not one of {sorted(PRESETS)}")
    config = PRESETS[cfg.model.preset]
    if mesh is not None:
        return create_sharded(config, mesh, dtype=dtype, seed=cfg.model.seed, remat=remat,
                              overrides=cfg.mesh.rules, strict=cfg.mesh.strict)
    return Qwen3(config, dtype=dtype, rngs=nnx.Rngs(cfg.model.seed), remat=remat)


def _rules(cfg: Any) -> Any:
    from retrojax.parallel.rules import rules_for

    return rules_for("train", cfg.mesh.rules)


def create_sharded(config: Any, mesh: Any, *, dtype: Any = jnp.float32, seed: int = 0, remat: bool = False,
                   overrides: Any = (), strict: bool = False) -> Any:
    """A random Qwen3 built directly sharded: ``jit`` with out_shardings over the abstract model.

    Same values as ``Qwen3(config, rngs=nnx.Rngs(seed))`` (the same key and draw), whatever the mesh.
    """
    import jax

    from retrojax.model.qwen3 import Qwen3, random_values
    from retrojax.parallel.shard import make_plan

    dtype = jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: Qwen3(config, dtype=dtype, remat=remat))
    plan = make_plan(model, mesh, overrides, strict)
    flat = {k: v for k, v in plan.params.items() if k != "layers"} | dict(plan.params["layers"])
    init = jax.jit(random_values, static_argnums=(1, 2), out_shardings=flat)
    values = init(nnx.Rngs(seed).params(), config, dtype)
    for name, value in values.items():
        owner = model.layers if name in plan.params["layers"] else model
        getattr(owner, name).set_value(value)
    return model


def build_tokenizer(cfg: Any) -> Any:
    """``model.tokenizer`` (or the checkpoint directory); the byte-level tokenizer when neither is set."""
    path = cfg.model.tokenizer or cfg.model.path
    if not path:
        return ByteTokenizer()
    from retrojax.model.tokenizer import load_tokenizer

    return load_tokenizer(path)
