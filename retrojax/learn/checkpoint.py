"""Training checkpoints with orbax: params, optimizer state and a JSON record of everything else.

Every process calls ``save`` and ``restore`` (orbax writes each array's shards once and the JSON from process
0); a step becomes visible only when complete (orbax writes into a temporary directory and renames it), so a
run killed mid-save resumes from the previous step. The JSON part holds the update step, RNG key data, the
data position (which tasks come next), the mesh it was written from and any other small state the trainer
needs to continue exactly; ``restore`` takes target trees whose shapes, dtypes and shardings the restored
arrays get, so a checkpoint restores onto any mesh. Keeps the last N.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_tree(tree: Any) -> Any:
    """Shape/dtype/sharding stand-ins for ``tree`` (a restore target): arrays are restored straight onto the
    target's devices and layout, whatever mesh the checkpoint was written from."""
    def one(x: Any) -> Any:
        if not hasattr(x, "shape"):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


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

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record of ``step`` (default: the latest) without reading any array."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def close(self) -> None:
        self.manager.close()
