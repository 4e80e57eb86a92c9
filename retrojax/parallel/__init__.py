"""Scale-out on one (data, fsdp, tp) mesh: mesh from config, logical-axis rules, activation constraints,
placement of params / optimizer state / batches / KV cache, per-process trial shares, jax.distributed start-up
and the persistent compilation cache. Importing this package touches no device."""

from retrojax.parallel.mesh import AXES, describe, make_mesh, mesh_from_config, resolve_shape
from retrojax.parallel.rules import (
    ROLLOUT_RULES,
    TRAIN_RULES,
    ShardingRuleError,
    activation_sharding,
    constrain,
    partition_spec,
    rules_for,
)

__all__ = [
    "AXES",
    "ROLLOUT_RULES",
    "TRAIN_RULES",
    "ShardingRuleError",
    "activation_sharding",
    "constrain",
    "describe",
    "make_mesh",
    "mesh_from_config",
    "partition_spec",
    "resolve_shape",
    "rules_for",
]
