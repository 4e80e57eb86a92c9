"""Placement of the model, optimizer state, training batches and KV cache on a mesh (one ``ShardingPlan``).

The plan is computed from abstract shapes only, so it can describe a model that is never allocated (the
memory plan of ``retrojax plan``). Params travel as the pure dict of ``nnx.to_pure_dict``; the plan mirrors
it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from retrojax.parallel.rules import Rules, partition_spec, rules_for
from retrojax.parallel.rules import _axes as _rule_axes


def param_axes(model: nnx.Module) -> dict[str, Any]:
    """Pure dict (same nesting as ``nnx.to_pure_dict``) of each parameter's logical axis names."""
    out: dict[str, Any] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            d = out
            for key in path[:-1]:
                d = d.setdefault(str(key), {})
            d[str(path[-1])] = tuple(node.get_metadata()["out_sharding"])
    return out


def param_shapes(model: nnx.Module) -> dict[str, Any]:
    """Pure dict of each parameter's ShapeDtypeStruct (works on abstract and concrete models)."""
    state = nnx.state(model, nnx.Param)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))


def param_specs(model: nnx.Module, mesh: Mesh, rules: Rules, strict: bool = False) -> dict[str, Any]:
    """Pure dict of NamedShardings for every parameter of ``model`` under ``rules``."""
    axes = param_axes(model)
    shapes = param_shapes(model)

    def one(path, shape):
        names = axes
        for k in path:
            names = names[k.key]
        return NamedSharding(mesh, partition_spec(names, shape.shape, mesh, rules, strict,
                                                  what="/".join(str(k.key) for k in path)))

    return jax.tree_util.tree_map_with_path(one, shapes)


def _path_names(path) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return tuple(out)


def optimizer_specs(tx: Any, params_abstract: Any, params_sh: Any, mesh: Mesh) -> Any:
    """Shardings of ``tx.init(params)``: a leaf that mirrors a parameter (Adam's mu/nu) takes that
    parameter's sharding; every other leaf (step counts, scalars) is replicated on the mesh (never
    host-local).
    """
    by_path = {_path_names(p): s for p, s in jax.tree_util.tree_flatten_with_path(params_sh)[0]}
    shape_of = {_path_names(p): a.shape for p, a in jax.tree_util.tree_flatten_with_path(params_abstract)[0]}
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(tx.init, params_abstract)

    def one(path, leaf):
        names = _path_names(path)
        for i in range(len(names)):
            tail = names[i:]
            if tail in by_path and shape_of[tail] == leaf.shape:
                return by_path[tail]
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract)


@dataclasses.dataclass
class ShardingPlan:
    """Where everything lives on ``mesh`` (train profile for the update, rollout profile for decoding)."""

    mesh: Mesh
    rules: Rules
    rollout_rules: Rules
    strict: bool
    params: Any  # pure dict of NamedSharding (train profile)
    rollout_params: Any  # pure dict of NamedSharding (rollout profile: tp only)
    opt: Any = None  # tree of NamedSharding mirroring tx.init(params)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def batch_shards(self) -> int:
        """How many ways a batch's rows are split (rows must be a multiple of this)."""
        axes = _rule_axes(self.row_axes)
        return int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1

    @property
    def batch_prefix(self) -> NamedSharding:
        """One sharding for every [rows, seq] array of a batch (a pytree prefix for jit's in_shardings)."""
        return NamedSharding(self.mesh, PartitionSpec(self.row_axes))

    @property
    def row_axes(self) -> Any:
        """The mesh axes a batch's rows are split over (None when not split)."""
        axes = tuple(a for a in _rule_axes(self.rules.get("batch")) if self.mesh.shape.get(a, 1) > 1)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def batch(self, shape: tuple[int, ...]) -> NamedSharding:
        """Sharding of a [rows, seq] training array: rows over data × fsdp."""
        names = ("batch", "seq")[:len(shape)] + (None,) * max(0, len(shape) - 2)
        return NamedSharding(self.mesh, partition_spec(names, shape, self.mesh, self.rules, self.strict,
                                                       what="batch"))

    def cache(self, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> NamedSharding:
        """Sharding of one KV cache leaf with logical ``axes`` (``qwen3.CACHE_K_AXES`` / ``CACHE_V_AXES``):
        rows over data × fsdp, kv heads over tp."""
        return NamedSharding(self.mesh, partition_spec(axes, shape, self.mesh, self.rollout_rules,
                                                       what="kv cache"))


def make_plan(model: nnx.Module, mesh: Mesh, overrides: Any = (), strict: bool = False,
              tx: Any = None) -> ShardingPlan:
    """The plan for ``model`` (abstract or concrete) on ``mesh``; with ``tx``, the optimizer's too."""
    rules = rules_for("train", overrides)
    rollout = rules_for("rollout", overrides)
    plan = ShardingPlan(mesh, rules, rollout, strict, param_specs(model, mesh, rules, strict),
                        param_specs(model, mesh, rollout, strict))
    if tx is not None:
        plan.opt = optimizer_specs(tx, param_shapes(model), plan.params, mesh)
    return plan


def plan_from_config(cfg: Any, model: nnx.Module, tx: Any = None, devices: Any = None) -> ShardingPlan:
    """``make_plan`` with the mesh, rule overrides and strictness of ``cfg.mesh``."""
    from retrojax.parallel.mesh import mesh_from_config

    m = cfg.mesh
    return make_plan(model, mesh_from_config(cfg, devices), m.rules, m.strict, tx)


def init_optimizer(tx: Any, params: Any, plan: ShardingPlan) -> Any:
    """``tx.init(params)`` built directly sharded by the plan (every leaf a global array on the mesh)."""
    return jax.jit(tx.init, out_shardings=plan.opt)(params)


def global_batch(arrays: dict[str, np.ndarray], plan: ShardingPlan) -> dict[str, jax.Array]:
    """This process's rows of a microbatch -> global arrays with rows over data × fsdp.

    Each process passes its own rows (same shapes on every process); the global batch is their
    concatenation in process order (``make_array_from_process_local_data``).
    """
    out = {}
    n = jax.process_count()
    for k, v in arrays.items():
        v = np.asarray(v)
        gshape = (v.shape[0] * n, *v.shape[1:])
        out[k] = jax.make_array_from_process_local_data(plan.batch(gshape), v, gshape)
    return out


def pad_rows(arrays: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Append all-zero rows (zero weight, masked out) so the row count is a multiple of ``multiple``."""
    rows = next(iter(arrays.values())).shape[0]
    extra = (-rows) % max(1, multiple)
    if not extra:
        return arrays
    return {k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)]) for k, v in arrays.items()}


def place_params(params: Any, shardings: Any) -> Any:
    """Put a params pure dict onto ``shardings`` (a no-op for leaves already there)."""
    return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s else jax.device_put(x, s),
                        params, shardings)


def to_local(x: jax.Array, local: Mesh) -> jax.Array:
    """A global array whose layout repeats over ``data`` -> the same array on this process's ``local`` mesh.

    Used for the per-host sampler replica: the rollout-profile weights already hold every local device's
    shard, so nothing moves between hosts.
    """
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
    target = NamedSharding(local, spec)
    shards = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, target, [shards[d] for d in target.addressable_devices_indices_map(x.shape)])


def zeros_like_sharded(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def model_mesh(model: nnx.Module) -> Mesh | None:
    """The mesh the model's weights live on, when it has more than one device (else None)."""
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.devices.size > 1:
            return sharding.mesh
    return None


def place_cache(cache: Any, model: nnx.Module) -> Any:
    """A sampler's KV cache laid out on the model's mesh: rows over data × fsdp, kv heads over tp.

    Identity for a single-device model. Rows or heads that do not divide stay replicated on that axis.
    """
    mesh = model_mesh(model)
    if mesh is None:
        return cache
    from retrojax.model.qwen3 import CACHE_K_AXES, CACHE_V_AXES

    rules = rules_for("rollout")

    def put(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        spec = partition_spec(axes, x.shape, mesh, rules, what="kv cache")
        return jax.device_put(x, NamedSharding(mesh, spec))

    return type(cache)(k=put(cache.k, CACHE_K_AXES), v=put(cache.v, CACHE_V_AXES))
