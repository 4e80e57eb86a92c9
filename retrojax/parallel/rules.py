"""Logical axis names -> mesh axes: parameter specs, activation constraints and the KV-cache layout.

Every Qwen3 weight carries logical axis names (``out_sharding`` metadata). A *rule set* maps each logical name
to a mesh axis, a tuple of mesh axes, or None (replicated). Two profiles share one mesh:

- ``train``: weights FSDP over ``fsdp`` (the embed dim) and tensor-parallel over ``tp`` (heads / mlp / vocab);
  activations' batch dim over ``data × fsdp``.
- ``rollout``: weights tp-only (replicated over ``data`` and ``fsdp``) so decoding never all-gathers a
  weight per token; cache rows over ``data × fsdp``, kv heads over ``tp``.

``strict`` mode raises when a rule cannot divide a dimension (or reuses a mesh axis in one spec) instead of
silently replicating that dimension.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rule = str | tuple[str, ...] | None
Rules = Mapping[str, Rule]

TRAIN_RULES: dict[str, Rule] = {
    # weights
    "vocab": "tp", "embed": "fsdp", "heads": "tp", "kv_heads": "tp", "mlp": "tp",
    "layers": None, "head_dim": None, "norm": None,
    # activations and cache
    "batch": ("data", "fsdp"), "seq": None, "act_embed": None, "act_heads": "tp", "act_kv_heads": "tp",
    "act_mlp": "tp", "act_vocab": "tp", "cache_batch": ("data", "fsdp"), "cache_seq": None,
}
ROLLOUT_RULES: dict[str, Rule] = {**TRAIN_RULES, "embed": None}
PROFILES = {"train": TRAIN_RULES, "rollout": ROLLOUT_RULES}


class ShardingRuleError(ValueError):
    """A rule that cannot apply in strict mode (dimension not divisible, mesh axis used twice)."""


def parse_overrides(items: Sequence[str] | Mapping[str, Any]) -> dict[str, Rule]:
    """``["embed=none", "batch=data+fsdp", "mlp=tp"]`` (or a mapping) -> rule overrides."""
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            if not isinstance(item, str) or item.count("=") != 1:
                raise ValueError(f"mesh rule override {item!r} must read 'logical=axis' (axis: none, tp, "
                                 "data+fsdp, ...)")
            pairs.append(tuple(s.strip() for s in item.split("=")))
    out: dict[str, Rule] = {}
    for name, value in pairs:
        if value is None or str(value).lower() in ("none", "null", ""):
            out[name] = None
        elif isinstance(value, (list, tuple)):
            out[name] = tuple(value)
        else:
            parts = tuple(p for p in str(value).split("+") if p)
            out[name] = parts[0] if len(parts) == 1 else parts
    from retrojax.parallel.mesh import AXES

    for name, rule in out.items():
        if name not in TRAIN_RULES:
            raise ValueError(f"mesh rule override names unknown logical axis {name!r}; known: "
                             f"{sorted(TRAIN_RULES)}")
        for axis in _axes(rule):
            if axis not in AXES:
                raise ValueError(f"mesh rule {name}={rule!r} names unknown mesh axis {axis!r}; known: {AXES}")
    return out


def rules_for(profile: str = "train", overrides: Sequence[str] | Mapping[str, Any] = ()) -> dict[str, Rule]:
    """The rule set of ``profile`` with ``overrides`` applied (overrides apply to both profiles)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown sharding profile {profile!r}; expected one of {sorted(PROFILES)}")
    return {**PROFILES[profile], **parse_overrides(overrides)}


def _axes(rule: Rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def partition_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules,
                   strict: bool = False, what: str = "array") -> PartitionSpec:
    """Spec for a value with logical ``axes`` and ``shape``: each mesh axis once, where it divides.

    Non-strict: a rule that does not divide its dimension (or names an axis already used) leaves that
    dimension replicated. Strict: raises ShardingRuleError instead. Mesh axes of size 1 are dropped.
    """
    if len(axes) != len(shape):
        raise ValueError(f"{what}: {len(axes)} logical axes {tuple(axes)} for shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[Any] = []
    for name, dim in zip(axes, shape, strict=True):
        wanted = [a for a in _axes(rules.get(name)) if a in mesh.shape and mesh.shape[a] > 1] if name else []
        reused = [a for a in wanted if a in used]
        size = math.prod(mesh.shape[a] for a in wanted)
        if wanted and (reused or dim % size):
            if strict:
                why = (f"mesh axis {reused} already used" if reused
                       else f"dimension {dim} is not divisible by {'×'.join(wanted)} = {size}")
                raise ShardingRuleError(f"{what}: logical axis {name!r} -> {rules.get(name)!r}: {why} "
                                        f"(shape {tuple(shape)}, mesh {dict(mesh.shape)})")
            wanted = []
        used.update(wanted)
        spec.append(None if not wanted else wanted[0] if len(wanted) == 1 else tuple(wanted))
    return PartitionSpec(*spec)


def named(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    return NamedSharding(mesh, spec)


# ---- activation constraints ---------------------------------------------------------------------------
_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules, bool] | None] = contextvars.ContextVar(
    "retrojax_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Rules | None = None,
                        strict: bool = False) -> Iterator[None]:
    """While tracing inside this context, :func:`constrain` pins activations to ``rules`` on ``mesh``."""
    token = _ACTIVE.set(None if mesh is None else (mesh, TRAIN_RULES if rules is None else rules, strict))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical axis names under the active mesh; identity outside one."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules, strict = active
    if mesh.devices.size == 1:
        return x
    spec = partition_spec(axes, x.shape, mesh, rules, strict=strict, what="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


class MeshFromArgs:
    """Wrap a jitted function so it traces under the rollout rules of the mesh its arguments live on.

    The sampler's module-level jits use this: with weights and cache on a multi-device mesh, the forward's
    constraints (KV-cache rows over data × fsdp, kv heads over tp) apply; on one device nothing changes.
    """

    def __init__(self, fn: Any, rules: Rules | None = None):
        self.fn = fn
        self.rules = ROLLOUT_RULES if rules is None else rules

    def _context(self, args: Any, kwargs: Any) -> Any:
        for leaf in jax.tree.leaves((args, kwargs)):
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding) and sharding.mesh.devices.size > 1:
                return activation_sharding(sharding.mesh, self.rules)
        return contextlib.nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._context(args, kwargs):
            return self.fn(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        with self._context(args, kwargs):
            return self.fn.lower(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)
