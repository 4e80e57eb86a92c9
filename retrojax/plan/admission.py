"""Admission: every entry point plans before it allocates (``sampler.max_inflight: auto`` and the fit check).

``train``, ``eval``, ``rir`` and ``serve`` call :func:`admit_run` / :func:`admit_rows` first. They take the
device's memory (what JAX reports for GPU/TPU, the host memory free now on CPU, or ``--device-memory 80GB``
to plan for another device) and:

- ``sampler.max_inflight: auto`` becomes the most sampler rows that fit beside what the run keeps resident
  (weights, the learner's float32 masters, AdamW moments, gradients, the KL reference, the sampler's per-layer
  weight copies where ``sampler.layer_copies`` keeps them - CPU, by default - update activations);
- an explicit ``max_inflight`` (or ``serve --max-batch``) that does not fit, or a run where not even one row
  fits, stops with :class:`DoesNotFit` before anything of that size is allocated: the plan's numbers and what
  to change.

A closed-form bound decides first (shapes and dtypes only; every term rounded up, so the rows it admits
fit): small runs - the tests, the demo - never compile anything for it. When the bound is tight, the trainer's
answer comes from the compile-only plan (:func:`retrojax.plan.memory.plan_memory`), which measures the
update's and the sampler's temporaries. KV bytes: a dense cache holds ``sampler.max_len`` slots per row
whatever a trial uses; a paged cache (the default) holds one pool of pages (``sampler.kv_pages``), sized here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from retrojax.plan.bound import (
    GB,
    USABLE,
    KVShape,
    decode_bytes_per_row,
    inference_resident_bytes,
    kv_bytes_per_row,
    layer_copies_kept,
    lora_settings,
    model_shape,
    parse_bytes,
    train_resident_bytes,
)

# Rows ``auto`` never exceeds (a host with terabytes does not need a million rows)
ROW_CAP = 4096


class DoesNotFit(ValueError):
    """The plan says the run does not fit the device: the message has the figures and what to change."""


class PoolDoesNotFit(DoesNotFit):
    """An explicit ``sampler.kv_pages`` that does not fit (no other plan can rescue it)."""


def device_memory_bytes() -> float | None:
    """The first device's memory limit (GPU/TPU ``memory_stats``), or for CPU devices the host memory free
    now (``MemAvailable``: a CPU "device" shares its RAM with this process's runtime and every other
    process, so its total would overstate what a run can take)."""
    import jax

    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        return None


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the plan decided: the rows to run, the page pool of a paged cache (None: dense, or every row at
    ``max_len``), and the figures behind them (``plan.*`` keys)."""

    max_inflight: int
    figures: dict[str, Any]
    kv_pages: int | None = None


def _rows_that_fit(budget: float, resident: float, per_row: float) -> int:
    return int(max(0.0, USABLE * budget - resident) // max(per_row, 1.0))


def _describe(parts: dict[str, float]) -> str:
    return " + ".join(f"{k.replace('_', ' ')} {v / GB:.2f}" for k, v in parts.items() if v > 0)


def admit_rows(*, job: str, resident: dict[str, float], per_row: float, budget: float, requested: Any,
               wanted: int | None, hint: str) -> Admission:
    """Rows for a run whose memory is ``resident`` + rows × ``per_row`` (closed form).

    ``requested``: ``auto`` or an explicit row count (0 = every row the job has, ``wanted``). ``hint`` says
    what to change when nothing fits.
    """
    fixed = sum(resident.values())
    fit = min(_rows_that_fit(budget, fixed, per_row), ROW_CAP)
    figures: dict[str, Any] = {
        "plan.job": job, "plan.device_gb": budget / GB, "plan.resident_gb": fixed / GB,
        **{f"plan.resident.{k}_gb": v / GB for k, v in resident.items()},
        "plan.per_row_gb": per_row / GB, "plan.max_inflight_fit": fit,
        "plan.max_inflight_setting": str(requested),
    }
    head = (f"{job}: {fixed / GB:.2f} GB resident ({_describe(resident)}) + {per_row / GB:.3f} GB per "
            f"sampler row on a {budget / GB:.1f} GB device (usable {USABLE:.0%})")
    if fit < 1:
        raise DoesNotFit(f"{head}: not even one row fits. {hint}")
    if requested == "auto":
        rows = fit if wanted is None else min(fit, wanted)
    else:
        rows = int(requested) or (wanted if wanted is not None else fit)
        if rows > fit:
            raise DoesNotFit(f"{head}: {rows} rows were asked for, at most {fit} fit. Set "
                             f"sampler.max_inflight to {fit} or less (or auto). {hint}")
    figures["plan.max_inflight"] = rows
    return Admission(rows, figures)


def admit_kv(*, job: str, kv: KVShape, resident: dict[str, float], budget: float, requested: Any,
             wanted: int | None, hint: str, pages: Any = "auto") -> Admission:
    """:func:`admit_rows` for the sampler's cache layout, and for a paged cache its pool: ``pages`` (auto:
    what is left once the rows' temporaries are counted; an explicit count must fit)."""
    parts, per_row = kv.split(resident)
    found = admit_rows(job=job, resident=parts, per_row=per_row, budget=budget, requested=requested,
                       wanted=wanted, hint=hint)
    if not kv.paged:
        found.figures["plan.kv"] = "dense"
        return found
    pool = kv.pool(budget, parts, found.max_inflight)
    if pages != "auto":
        pool = int(pages)
        need = sum(parts.values()) - parts["kv_pool_floor"] + pool * kv.page_bytes() \
            + found.max_inflight * decode_bytes_per_row(kv.config)
        if pool < kv.row_pages() + 1 or need > USABLE * budget:
            raise PoolDoesNotFit(f"{job}: sampler.kv_pages {pool} needs {need / GB:.2f} GB of a "
                                 f"{budget / GB:.1f} GB device (usable {USABLE:.0%}) and at least "
                                 f"{kv.row_pages() + 1} pages (one row at max_len). Set sampler.kv_pages to "
                                 f"auto. {hint}")
    found.figures.update({"plan.kv": "paged", "plan.kv_pages": pool,
                          "plan.kv_pool_gb": pool * kv.page_bytes() / GB})
    return dataclasses.replace(found, kv_pages=pool)


def _train_hint(cfg: Any) -> str:
    tips = []
    if lora_settings(cfg) is None:
        tips.append("train LoRA adapters (learn.lora.rank > 0)")
    if cfg.learn.master_dtype == "float32" and cfg.model.dtype != "float32":
        tips.append("keep no float32 masters (learn.master_dtype=model, knowingly)")
    tips += ["shorten sampler.max_len", "shard over more devices (mesh)", "use a smaller model"]
    return "To fit: " + ", ".join(tips) + "."


def check_certain(cfg: Any, budget: float) -> None:
    """``DoesNotFit`` when the exactly known parts of a training run - weights, masters, AdamW, gradients,
    the reference, the sampler's weight copies and one KV row - exceed ``budget`` (no compile needed)."""
    c = model_shape(cfg)
    certain = {k: v for k, v in train_resident_bytes(cfg).items() if k != "activations"}
    row = kv_bytes_per_row(c, cfg.sampler.max_len, cfg.model.dtype)
    need = sum(certain.values()) + row
    if need > budget:
        raise DoesNotFit(f"train: the weights, optimizer state and one sampler row alone need "
                         f"{need / GB:.2f} GB ({_describe(certain)} + one row {row / GB:.3f}) of a "
                         f"{budget / GB:.1f} GB device. {_train_hint(cfg)}")


def admit_train(cfg: Any, budget: float, remat: bool = False, log: Any = None,
                standin: bool | None = None) -> Admission:
    """Rows for ``retrojax train`` (``remat``: the resolved ``learn.remat``): the closed-form bound when it
    admits every row of an update (or an explicit count), else the compile-only plan's figures.
    ``standin`` (:func:`retrojax.plan.memory.plan_memory`): False when the run executes on this CPU, so
    the plan counts what XLA:CPU holds (its float32 upcasts of bfloat16 operands included)."""
    kv = KVShape.of(cfg)
    wanted = cfg.learn.tasks_per_update * cfg.trial.trials_per_task
    resident = train_resident_bytes(cfg, remat)
    requested = cfg.sampler.max_inflight
    hint = _train_hint(cfg)
    try:
        found = admit_kv(job="train", kv=kv, resident=resident, budget=budget, requested=requested,
                         wanted=wanted, hint=hint, pages=getattr(cfg.sampler, "kv_pages", "auto"))
        if found.max_inflight >= wanted or requested not in ("auto", 0):
            found.figures["plan.method"] = "bound"
            return found
        says = f"at most {found.max_inflight} of {wanted} rows"
    except PoolDoesNotFit:
        raise
    except DoesNotFit:
        check_certain(cfg, budget)
        says = "no row"
    if log is not None:  # the bound is tight: the compiled programs' own figures decide
        log(f"plan: the closed-form bound admits {says}; compiling the plan")
    from retrojax.plan.memory import plan_memory

    rows = wanted if requested == "auto" or not requested else int(requested)
    planned = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, max_inflight=rows),
                                  learn=dataclasses.replace(cfg.learn, remat=remat))
    figures = plan_memory(planned, budget, log=log or (lambda _: None), compare=False, standin=standin)
    fit = min(int(figures["plan.max_inflight_fit"]), ROW_CAP)
    figures.update({"plan.job": "train", "plan.method": "compile",
                    "plan.max_inflight_setting": str(requested)})
    # the plan's fit counts the update, the log-prob pass and rollouts, each with that many KV rows held
    if fit < 1:
        raise DoesNotFit(f"train: {figures.get('plan.reason', 'not even one sampler row fits')}. {hint}")
    if requested == "auto":
        rows = min(fit, wanted)
    elif rows > fit:
        raise DoesNotFit(f"train: {rows} sampler rows were asked for, at most {fit} fit "
                         f"({figures.get('plan.reason', '')}). Set sampler.max_inflight to {fit} or less "
                         f"(or auto). {hint}")
    if "plan.reason" in figures:  # what would not fit at every row of the update; these rows do
        figures["plan.reason_at_every_row"] = figures.pop("plan.reason")
    figures["plan.fits"] = True
    figures["plan.max_inflight"] = rows
    # the compiled plan counted the pool it sized as the bound does (retrojax.plan.memory.kv_pages)
    pages = figures.get("plan.kv_pages") if kv.paged else None
    return Admission(rows, figures, None if pages is None else int(pages))


def admit_decoding(cfg: Any, budget: float, config: Any = None, job: str = "eval") -> Admission:
    """Rows for a decoding-only run (``eval``/``rir`` with a model policy): weights + rows of KV."""
    kv = KVShape.of(cfg, config)
    resident = inference_resident_bytes(kv.config, cfg.model.dtype, layer_copies_kept(cfg))
    return admit_kv(job=job, kv=kv, resident=resident,
                    budget=budget, requested=cfg.sampler.max_inflight, wanted=None,
                    pages=getattr(cfg.sampler, "kv_pages", "auto"),
                    hint="To fit: shorten sampler.max_len, lower sampler.max_inflight or use a smaller "
                         "model.")


def admit_serving(model_dir: Any, dtype: str, rows: int, max_len: int, device_memory: str | None = None,
                  kv: str = "paged") -> Admission:
    """``retrojax serve``: ``rows`` (``--max-batch``) rows beside the weights (dense: ``max_len`` slots each;
    paged: a pool of what is left, at least one row at ``max_len``), or ``DoesNotFit`` before the checkpoint
    is read."""
    from retrojax.model.qwen3 import Qwen3Config

    config = Qwen3Config.from_json(model_dir)
    shape = KVShape(config, max_len, dtype, kv == "paged")
    return admit_kv(job="serve", kv=shape, resident=inference_resident_bytes(config, dtype),
                    budget=device_budget(device_memory), requested=rows, wanted=rows,
                    hint="To fit: lower --max-batch or --max-len, or serve a smaller model.")


def resolve(cfg: Any, admission: Admission) -> Any:
    """``cfg`` with ``sampler.max_inflight`` (and a paged cache's ``kv_pages``) set to what was admitted."""
    sampler = dataclasses.replace(cfg.sampler, max_inflight=admission.max_inflight)
    if admission.kv_pages is not None:
        sampler = dataclasses.replace(sampler, kv_pages=admission.kv_pages)
    return dataclasses.replace(cfg, sampler=sampler)


def device_budget(device_memory: str | None) -> float:
    """``--device-memory`` in bytes when given, else the device's own memory (retrojax.plan.runtime)."""
    if device_memory:
        return parse_bytes(device_memory)
    found = device_memory_bytes()
    if found is None:
        raise ValueError("the device reports no memory size: pass --device-memory (e.g. 80GB)")
    return found


def summary(admission: Admission) -> str:
    """One log line: the setting, the rows chosen, and how they were found."""
    f = admission.figures
    n = admission.max_inflight
    pool = "" if admission.kv_pages is None else f", a pool of {admission.kv_pages} KV pages"
    return (f"plan: sampler.max_inflight {f['plan.max_inflight_setting']} -> {n} row{'s' if n != 1 else ''}"
            f"{pool} (fit {f['plan.max_inflight_fit']} on {f['plan.device_gb']:.1f} GB, by the "
            f"{f.get('plan.method', 'bound')})")


__all__ = ["Admission", "DoesNotFit", "KVShape", "admit_decoding", "admit_kv", "admit_rows", "admit_serving",
           "admit_train", "device_budget", "resolve", "summary"]
