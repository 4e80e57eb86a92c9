"""LoRA adapters on the Flax Qwen3: rank-r updates W + (alpha / r) · A · B on chosen projections.

The rule (rank, alpha, dropout, initializers) is a ``qwix.LoraRule`` and the adapters are ``nnx.LoRAParam``
variables named as qwix names them (``q_lora_a``, ``q_lora_b``), but the adapters are applied here rather
than by ``qwix.apply_lora_to_model``: qwix finds a weight by tracing an einsum operand back to an attribute of
the module running it, and our decoder runs its layers as a ``lax.scan`` over weights stacked on a
``layers`` axis, so inside the scan no operand is such an attribute. On this model qwix 0.1.8 adapts only the
tied LM head (measured: it created ``embed_lora_a`` / ``embed_lora_b`` and nothing in the layers). Instead
:class:`LoraLayers` stacks each adapter on the same ``layers`` axis, and the decoder's projections add
``x · A · B`` when a layer's weights dict carries them (``qwen3._with_adapter``): training, prefill and the
sampler's per-step decode all see the adapters, and the scan/unrolled decode paths stay as they are.

Shapes (one layer; the stored arrays have a leading ``layers`` axis):

=========  ===================  ================  ===================  =================
target     base weight          A                 B                    PEFT module
=========  ===================  ================  ===================  =================
q          [H, N, D]            [H, r]            [r, N, D]            self_attn.q_proj
k, v       [H, K, D]            [H, r]            [r, K, D]            self_attn.k_proj / v_proj
o          [N, D, H]            [N, D, r]         [r, H]               self_attn.o_proj
gate, up   [H, M]               [H, r]            [r, M]               mlp.gate_proj / up_proj
down       [M, H]               [M, r]            [r, H]               mlp.down_proj
=========  ===================  ================  ===================  =================

Each adapter's logical axes inherit the base weight's (A keeps its input axes, B its output axes; the rank
axis is replicated), so the train/rollout sharding rules place adapters next to the weights they adapt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from retrojax.model.qwen3 import _LAYER_AXES, Qwen3, Qwen3Layers

TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
# how many leading axes (after ``layers``) of each base weight are its inputs
_IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
# the PEFT / transformers module of each target
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """Validated target names (our q/k/v/o/gate/up/down, or transformers' q_proj, …, down_proj)."""
    out: list[str] = []
    for t in targets:
        name = str(t).removesuffix("_proj")
        if name not in TARGETS:
            raise ValueError(f"LoRA target {t!r} is not a Qwen3 projection; expected some of {TARGETS} "
                             "(or q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("LoRA needs at least one target projection")
    return tuple(t for t in TARGETS if t in out)


def adapter_shapes(base_shape: Sequence[int], target: str,
                   rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A shape, B shape), both with the leading layers axis, for a stacked base weight of ``base_shape``."""
    n_in = _IN_AXES[target]
    layers, ins, outs = base_shape[0], tuple(base_shape[1:1 + n_in]), tuple(base_shape[1 + n_in:])
    return (layers, *ins, rank), (layers, rank, *outs)


def adapter_axes(target: str) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
    """Logical axis names of (A, B): the base weight's input axes + rank, rank + its output axes."""
    axes = _LAYER_AXES[target]
    n_in = _IN_AXES[target]
    return (*axes[:1 + n_in], None), (axes[0], None, *axes[1 + n_in:])


def lora_rule(rank: int, alpha: float, dropout: float = 0.0) -> Any:
    """The ``qwix.LoraRule`` of these settings (its initializers: A he-uniform over the fan-in, B zeros)."""
    import qwix

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    return qwix.LoraRule(module_path=".*", rank=rank, alpha=float(alpha), dropout=float(dropout))


class LoraLayers(Qwen3Layers):
    """The decoder's stacked weights (the same variables as the base model's) plus stacked adapters.

    ``arrays()`` hands the decoder each target's ``A · scale`` and ``B`` next to its weights, so every path
    through ``Qwen3`` (the training scan, prefill, per-step decode) applies them.
    """

    def __init__(self, base: Qwen3Layers, adapters: Mapping[str, tuple[jax.Array, jax.Array]], *,
                 rank: int, scale: float, dropout: float = 0.0):
        for name in _LAYER_AXES:
            setattr(self, name, getattr(base, name))
        self.targets = tuple(t for t in TARGETS if t in adapters)
        self.rank = int(rank)
        self.scale = float(scale)
        self.dropout = float(dropout)
        for t in self.targets:
            a, b = adapters[t]
            a_axes, b_axes = adapter_axes(t)
            setattr(self, f"{t}_lora_a", nnx.LoRAParam(a, out_sharding=a_axes, eager_sharding=False))
            setattr(self, f"{t}_lora_b", nnx.LoRAParam(b, out_sharding=b_axes, eager_sharding=False))

    def adapter(self, target: str) -> tuple[jax.Array, jax.Array]:
        """(A, B) of ``target``, unscaled, with the layers axis."""
        return getattr(self, f"{target}_lora_a")[...], getattr(self, f"{target}_lora_b")[...]

    def arrays(self) -> dict[str, jax.Array]:
        out = super().arrays()
        for t in self.targets:
            a, b = self.adapter(t)
            out[f"{t}_lora_a"] = a * jnp.asarray(self.scale, a.dtype)
            out[f"{t}_lora_b"] = b
        return out


def is_lora(model: Any) -> bool:
    return isinstance(getattr(model, "layers", None), LoraLayers)


def _init_adapters(key: jax.Array, layers: Qwen3Layers, targets: Sequence[str], rule: Any,
                   dtype: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Per layer: A from the rule's initializer on its [fan_in, r] matrix, B from its (zeros) initializer."""
    out = {}
    for i, t in enumerate(targets):
        base_shape = tuple(getattr(layers, t).shape)
        a_shape, b_shape = adapter_shapes(base_shape, t, rule.rank)
        fan_in, fan_out = math.prod(a_shape[1:-1]), math.prod(b_shape[2:])
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        a = jax.vmap(lambda k, n=fan_in: rule.lora_a_initializer(k, (n, rule.rank), dtype))(
            jax.random.split(ka, a_shape[0]))
        b = jax.vmap(lambda k, n=fan_out: rule.lora_b_initializer(k, (rule.rank, n), dtype))(
            jax.random.split(kb, b_shape[0]))
        out[t] = (a.reshape(a_shape), b.reshape(b_shape))
    return out


def apply_lora(model: Qwen3, *, rank: int, alpha: float, targets: Sequence[str] = TARGETS,
               dropout: float = 0.0, dtype: Any = jnp.float32, seed: int = 0,
               adapters: Mapping[str, tuple[Any, Any]] | None = None, scale: float | None = None) -> Qwen3:
    """Give ``model`` (in place; also returned) LoRA adapters on ``targets``.

    New adapters follow the qwix rule's initializers (B = 0, so the model's outputs are unchanged);
    ``adapters`` (target -> (A, B) with the layers axis) sets them instead, e.g. from a PEFT directory.
    ``scale`` overrides alpha / rank (rsLoRA adapters use alpha / sqrt(rank)). On a mesh the adapters are
    placed next to their base weights: A sharded like the weight's inputs, B like its outputs.
    """
    if is_lora(model):
        raise ValueError("the model already has LoRA adapters")
    rule = lora_rule(rank, alpha, dropout)
    targets = check_targets(targets)
    dtype = jnp.dtype(dtype)
    base = model.layers
    if adapters is None:
        values = _init_adapters(jax.random.PRNGKey(seed), base, targets, rule, dtype)
    else:
        values = {}
        for t in targets:
            if t not in adapters:
                raise ValueError(f"no adapter given for target {t!r}")
            want = adapter_shapes(tuple(getattr(base, t).shape), t, rank)
            a, b = (jnp.asarray(x, dtype) for x in adapters[t])
            if (tuple(a.shape), tuple(b.shape)) != want:
                raise ValueError(f"adapter {t!r} has shapes {a.shape}, {b.shape}; the model needs {want}")
            values[t] = (a, b)
    values = _place_like_base(values, base)
    model.layers = LoraLayers(base, values, rank=rank, scale=alpha / rank if scale is None else scale,
                              dropout=dropout)
    return model


def _place_like_base(values: dict[str, tuple[jax.Array, jax.Array]], base: Qwen3Layers) -> dict:
    """Adapters onto the mesh of the base weights (train rules), when the base lives on one."""
    from jax.sharding import NamedSharding

    from retrojax.parallel.rules import TRAIN_RULES, partition_spec

    leaf = base.q[...]
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.devices.size <= 1:
        return values
    mesh = sharding.mesh
    out = {}
    for t, (a, b) in values.items():
        placed = []
        for x, axes in zip((a, b), adapter_axes(t), strict=True):
            spec = partition_spec(axes, x.shape, mesh, TRAIN_RULES, what=f"{t} adapter")
            placed.append(jax.device_put(x, NamedSharding(mesh, spec)))
        out[t] = tuple(placed)
    return out


def delta(layers: LoraLayers, target: str) -> jax.Array:
    """scale · A · B for every layer, in the base weight's shape and in float32."""
    a, b = layers.adapter(target)
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    fan_in = math.prod(a.shape[1:-1])
    flat = jnp.einsum("lir,lro->lio", a32.reshape(a.shape[0], fan_in, -1),
                      b32.reshape(b.shape[0], b.shape[1], -1))
    return (layers.scale * flat).reshape(getattr(layers, target).shape)


def merge_lora(model: Qwen3) -> Qwen3:
    """A plain ``Qwen3`` whose weights are W + scale · A · B (computed in fp32, stored in the base dtype).

    The input model is left as it is. Used for merged decoding and for exporting full weights.
    """
    if not is_lora(model):
        raise ValueError("merge_lora needs a model with LoRA adapters")
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)  # a copy that shares no Variable objects with ``model``
    layers = merged.layers
    values = {name: getattr(layers, name)[...] for name in _LAYER_AXES}
    for t in layers.targets:
        values[t] = (values[t].astype(jnp.float32) + delta(layers, t)).astype(values[t].dtype)
    merged.layers = Qwen3Layers(values)
    return merged


def adapter_values(model: Qwen3) -> dict[str, tuple[jax.Array, jax.Array]]:
    """target -> (A, B) (unscaled, with the layers axis) of a LoRA model."""
    if not is_lora(model):
        raise ValueError("the model has no LoRA adapters")
    return {t: model.layers.adapter(t) for t in model.layers.targets}


def trainable_fraction(model: Qwen3) -> float:
    """Adapter parameters ÷ all parameters (base + adapters)."""
    n_lora = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    n_all = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return n_lora / n_all


def join_params(trainable: Mapping[str, Any], frozen: Mapping[str, Any] | None) -> dict[str, Any]:
    """One pure params dict from the trainable part (adapters) and the frozen part (base), nested by key."""
    if frozen is None:
        return dict(trainable)
    out = dict(frozen)
    for k, v in trainable.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = join_params(v, out[k])
        elif k in out:
            raise ValueError(f"parameter {k!r} is both trainable and frozen")
        else:
            out[k] = v
    return out


def split_params(model: nnx.Module) -> tuple[Any, Any, dict[str, Any], dict[str, Any] | None]:
    """(graphdef, abstract state template, trainable pure dict, frozen pure dict or None).

    With LoRA adapters only the adapters train (the base is frozen: no gradient, no optimizer state);
    without, every parameter trains and the frozen part is None.
    """
    graphdef, state = nnx.split(model)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    if not is_lora(model):
        return graphdef, template, nnx.to_pure_dict(state), None
    _, adapters, base = nnx.split(model, nnx.LoRAParam, ...)
    return graphdef, template, nnx.to_pure_dict(adapters), nnx.to_pure_dict(base)


def _pick(tree: Mapping[str, Any], like: Mapping[str, Any]) -> dict[str, Any]:
    """The part of nested dict ``tree`` with the keys of ``like``."""
    return {k: _pick(tree[k], v) if isinstance(v, Mapping) else tree[k] for k, v in like.items()}


def lora_plan(plan: Any, model: nnx.Module, tx: Any = None) -> Any:
    """A ``ShardingPlan`` for training a LoRA model: ``params`` (and the optimizer's shardings) cover the
    adapters only and a new ``frozen`` field holds the base weights' shardings; ``rollout_params`` stays
    the whole model's (the sampler decodes base + adapters)."""
    import dataclasses

    from retrojax.parallel.shard import optimizer_specs

    _, _, adapters, base = split_params(model)
    if base is None:
        return plan
    out = dataclasses.replace(plan, params=_pick(plan.params, adapters))
    out.frozen = _pick(plan.params, base)
    if tx is not None:
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), adapters)
        out.opt = optimizer_specs(tx, shapes, out.params, plan.mesh)
    return out


def base_pointer(model_cfg: Any) -> dict[str, Any]:
    """What an adapters-only checkpoint needs to find its base again: the ``model`` config section's
    checkpoint path (or preset and seed), dtype and any PEFT adapter the training started from."""
    name = model_cfg.path or f"preset:{model_cfg.preset}"
    return {"name": name, "path": model_cfg.path, "preset": model_cfg.preset, "seed": model_cfg.seed,
            "dtype": model_cfg.dtype, "adapter": getattr(model_cfg, "adapter", None)}


# generate / serve decode a LoRA policy from merged weights (W + scale · A · B) rather than applying the
# adapters at every step: 10% faster at the Qwen3-0.6B shape on CPU (docs/lora-and-memory.md). The
# trainer's rollouts apply them per step, so no merged copy of the base sits next to the training state.
DECODE_MERGED = True


def for_decoding(model: Any) -> Any:
    """The model a sampler should decode with: merged weights for a LoRA policy (``DECODE_MERGED``)."""
    return merge_lora(model) if DECODE_MERGED and is_lora(model) else model
