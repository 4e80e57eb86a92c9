"""The plan inside a run: the device's memory, ``learn.remat: auto`` and the figures the trainer logs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from retrojax.plan.admission import device_memory_bytes, train_resident_bytes
from retrojax.plan.memory import GB, shapes_from_config, shard_bytes

# the last compile-only update plan made by resolve_remat in this process (the trainer logs it)
LAST_PLAN: dict[str, Any] = {}


def _rough_update_bytes(cfg: Any) -> float:
    """A generous bound on one update without remat (every activation kept, float32 masters and AdamW, the
    sampler's weight copies; retrojax.plan.admission): when even this fits, auto needs no compile."""
    return float(sum(train_resident_bytes(cfg, remat=False).values()))


def resolve_remat(cfg: Any, log=None, budget: float | None = None) -> bool:
    """``learn.remat`` as a bool. ``auto``: off when the update fits the device (``budget`` bytes, default
    what the device reports) without remat (a rough bound first; otherwise a compile-only plan on this run's
    mesh), else on."""
    setting = cfg.learn.remat
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"learn.remat must be true | false | auto, got {setting!r}")
    budget = device_memory_bytes() if budget is None else budget
    if budget is None or _rough_update_bytes(cfg) <= 0.5 * budget:
        return False
    from retrojax.parallel.mesh import config_mesh
    from retrojax.plan.memory import plan_update, sampler_held_bytes

    mesh = config_mesh(cfg)
    shards = 1
    if mesh is not None:
        from retrojax.parallel.rules import _axes, rules_for

        rules = rules_for("train", cfg.mesh.rules)
        shards = math.prod(mesh.shape[a] for a in _axes(rules.get("batch")) if a in mesh.shape)
    shapes = shapes_from_config(cfg, shards)
    found = plan_update(cfg, shapes, mesh, remat=False, lora=shapes.lora)
    held = sampler_held_bytes(cfg, shapes, mesh, shapes.lora)  # the sampler's cache etc. stay resident
    remat = found["update"] + held > budget
    LAST_PLAN.clear()
    LAST_PLAN.update({"plan.no_remat.update_gb": (found["update"] + held) / GB,
                      "plan.no_remat.act_gb": found["act"] / GB, "plan.sampler_held_gb": held / GB,
                      "plan.device_gb": budget / GB, "plan.remat": remat})
    if log is not None:
        log(f"learn.remat auto: the update without remat needs {(found['update'] + held) / GB:.2f} GB per "
            f"device (with the sampler's {held / GB:.2f} GB held) of {budget / GB:.1f} GB -> remat "
            f"{'on' if remat else 'off'}")
    return remat


def log_trainer_plan(trainer: Any, out_dir: str | Path | None = None) -> dict[str, Any]:
    """The plan figures of a trainer's actual arrays (per device): parameters (trainable and frozen), AdamW
    state, the gradient accumulator (= trainable), plus the remat decision and any compile-only figures
    of this process. Printed as one line and written to ``out_dir/plan.json``."""
    params = shard_bytes(trainer.params)
    frozen = 0 if getattr(trainer, "frozen", None) is None else shard_bytes(trainer.frozen)
    out: dict[str, Any] = {
        "plan.route": "lora" if frozen else "full",
        "plan.params_gb": (params + frozen) / GB,
        "plan.trainable_gb": params / GB,
        "plan.opt_gb": shard_bytes(trainer.opt_state) / GB,
        "plan.grads_gb": params / GB,
        "plan.remat_setting": str(trainer.cfg.learn.remat),
        **LAST_PLAN,
    }
    budget = device_memory_bytes()
    if budget is not None:
        out.setdefault("plan.device_gb", budget / GB)
    print("plan: " + ", ".join(f"{k.removeprefix('plan.')} {v:.3g}" if isinstance(v, float) else
                               f"{k.removeprefix('plan.')} {v}" for k, v in out.items()), file=sys.stderr)
    if out_dir is not None:
        (Path(out_dir) / "plan.json").write_text(json.dumps(out, indent=1))
    return out
