"""Training checkpoints with orbax: params, optimizer state and a JSON record of everything else.

The JSON part holds the update step, RNG key data, the data position (which tasks come next) and any other
small state the trainer needs to continue exactly; ``restore`` needs abstract trees (shapes/dtypes) of params
and optimizer state so the restored arrays have the same structure as freshly built ones. Keeps the last N.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_tree(tree: Any) -> Any:
    """Shape/dtype stand-ins for ``tree`` (a restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, tree)


class TrainCheckpoints:
    """``save(step, params, opt_state, meta)`` / ``restore(params_like, opt_like, step=None)``."""

    def __init__(self, directory: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be ≥ 1, got {keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("params", "opt_state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
        ))
        self.manager.wait_until_finished()

    def restore(self, params_like: Any, opt_like: Any, step: int | None = None) -> tuple[Any, Any, dict]:
        """(params, opt_state, meta) of ``step`` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_tree(params_like)),
            opt_state=ocp.args.StandardRestore(abstract_tree(opt_like)),
            meta=ocp.args.JsonRestore(),
        ))
        return out["params"], out["opt_state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.close()
