"""``retrojax bench textworlds``: the host-side text-world bridge (ScienceWorld, ALFWorld).

Figures (stable keys, milliseconds unless named otherwise):

- ``scienceworld.step_ms.bridge``: one step through the bridge (worker IPC + the Java server's own step,
  score and state key), mean over the gold path of ``find-living-thing`` variations; ``.engine``: the
  bare server step in-process; ``.wrapper``: the PyPI wrapper's ``env.step`` (which recomputes every
  valid action) on the same actions, in the same run.
- ``scienceworld.reset_ms`` and ``scienceworld.rewind_ms_per_action``: a rewind to C_j is reset + replay
  of j actions + the observation check; per action = (rewind time − reset time) / j, measured at the
  end of the gold path.
- ``alfworld.step_ms``, ``alfworld.reset_ms``, ``alfworld.rewind_ms_per_action``: the same for ALFWorld
  on generated games (expert-planner paths over the six task types).
- ``<world>.steps_per_s.{1,2,4}``: throughput of batched steps with 1, 2 and 4 workers, one trial per
  worker, each walking its expert path (rewinds to C_0 between rounds are not timed).

The workers' result cache is off here (``result_cache=0``), so every figure is a real engine call.
``--quick`` (smoke test): one task per world (both workers of the 2-worker run walk it), one round, and
only 1 and 2 workers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

from envs.textworlds import TextWorldBridge
from envs.textworlds.alfworld_gen import TASK_TYPES
from retrojax.bench import run_and_report

SW_TASKS = ("find-living-thing:3", "find-living-thing:4", "find-living-thing:5", "find-living-thing:6")


def _expert_path(br: TextWorldBridge, trial: int, max_steps: int = 40) -> list[str]:
    """Walk the expert from the trial's current state to the end; returns the actions."""
    for _ in range(max_steps):
        if br.record(trial).current.done:
            break
        (ex,) = br.expert([trial])
        if not ex.ok or ex.value is None:
            break
        (out,) = br.step([trial], [ex.value])
        if not out.ok:
            raise RuntimeError(out.error)
    return br.path(trial)


def _time_world(
    world: str, tasks: list[str], kwargs: dict, rounds: int, log: Callable[[str], None]
) -> tuple[dict[str, float], list[list[str]]]:
    """Single-worker step / reset / rewind figures on expert paths."""
    figures: dict[str, float] = {}
    with TextWorldBridge(world, num_workers=1, timeout_s=300.0, world_kwargs=kwargs, result_cache=0) as br:
        outs = br.reset(tasks)
        paths = [_expert_path(br, o.trial) for o in outs]
        log(f"{world}: expert paths of length {[len(p) for p in paths]}")
        step_s, steps, reset_s, resets, per_action = 0.0, 0, 0.0, 0, []
        for _ in range(rounds):
            for o, path in zip(outs, paths, strict=True):
                br.rewind([o.trial], [0])  # the worker's engine may hold another task: load this one
                t0 = time.perf_counter()
                br.rewind([o.trial], [0])  # now a pure reset (replay of nothing)
                reset_s += time.perf_counter() - t0
                resets += 1
                for a in path:
                    t0 = time.perf_counter()
                    (r,) = br.step([o.trial], [a])
                    step_s += time.perf_counter() - t0
                    steps += 1
                    if not r.ok:
                        raise RuntimeError(r.error)
                t0 = time.perf_counter()
                (rw,) = br.rewind([o.trial], [len(path)])
                rewind = time.perf_counter() - t0
                if not rw.ok:
                    raise RuntimeError(rw.error)
                per_action.append(rewind / len(path))
        figures["step_ms"] = 1000 * step_s / steps
        figures["reset_ms"] = 1000 * reset_s / resets
        mean_reset = reset_s / resets
        mean_len = sum(len(p) for p in paths) / len(paths)
        total_rewind = sum(per_action) / len(per_action) * mean_len
        figures["rewind_ms_per_action"] = 1000 * max(0.0, total_rewind - mean_reset) / mean_len
        figures["rewind_ms_per_action_incl_reset"] = 1000 * sum(per_action) / len(per_action)
    return figures, paths


def _throughput(world: str, tasks: list[str], paths: list[list[str]], kwargs: dict, workers: int,
                rounds: int) -> float:
    """Steps/s of batched steps with ``workers`` workers, one trial per worker."""
    with TextWorldBridge(world, num_workers=workers, timeout_s=300.0, world_kwargs=kwargs,
                         result_cache=0) as br:
        chosen = [i % len(tasks) for i in range(workers)]
        outs = br.reset([tasks[i] for i in chosen])
        trials = [o.trial for o in outs]
        length = min(len(paths[i]) for i in chosen)
        # one untimed round: every worker loads its task and warms its engine
        for s in range(length):
            br.step(trials, [paths[i][s] for i in chosen])
        br.rewind(trials, [0] * workers)
        busy, steps = 0.0, 0
        for _ in range(rounds):
            for s in range(length):
                t0 = time.perf_counter()
                outs = br.step(trials, [paths[i][s] for i in chosen])
                busy += time.perf_counter() - t0
                steps += sum(o.ok for o in outs)
            br.rewind(trials, [0] * workers)
    return steps / busy


def _scienceworld_engine_ms(task: str, path: list[str], rounds: int) -> tuple[float, float]:
    """(bare server step, wrapper env.step) in ms per step, in-process, on the same actions."""
    from scienceworld import ScienceWorldEnv

    from envs.textworlds.scienceworld import parse_task

    name, var = parse_task(task)
    env = ScienceWorldEnv("", envStepLimit=1000)
    try:
        env.load(name, var, "")
        for _ in range(2):  # warm the fresh JVM's JIT (the bridge's engines are warm by now)
            env.reset()
            for a in path:
                env.step(a)
        raw, wrapped, n = 0.0, 0.0, 0
        for _ in range(rounds):
            env.reset()
            for a in path:
                t0 = time.perf_counter()
                env.server.step(a)
                env.server.getScore()
                raw += time.perf_counter() - t0
                n += 1
            env.reset()
            for a in path:
                t0 = time.perf_counter()
                env.step(a)
                wrapped += time.perf_counter() - t0
    finally:
        env.close()
    return 1000 * raw / n, 1000 * wrapped / n


def run(quick: bool = False, log: Callable[[str], None] = print) -> dict[str, float]:
    figures: dict[str, float] = {}
    rounds = 1 if quick else 3
    worker_counts = (1, 2) if quick else (1, 2, 4)
    with tempfile.TemporaryDirectory(prefix="retrojax-bench-tw-") as cache:
        sw_kwargs = {"cache_dir": cache}
        sw_tasks = list(SW_TASKS[:1] if quick else SW_TASKS)
        sw, sw_paths = _time_world("scienceworld", sw_tasks, sw_kwargs, rounds, log)
        figures["scienceworld.step_ms.bridge"] = sw["step_ms"]
        figures["scienceworld.reset_ms"] = sw["reset_ms"]
        figures["scienceworld.rewind_ms_per_action"] = sw["rewind_ms_per_action"]
        figures["scienceworld.rewind_ms_per_action_incl_reset"] = sw["rewind_ms_per_action_incl_reset"]
        engine, wrapper = _scienceworld_engine_ms(sw_tasks[0], sw_paths[0], rounds)
        figures["scienceworld.step_ms.engine"] = engine
        figures["scienceworld.step_ms.wrapper"] = wrapper
        log(f"scienceworld: {sw}, engine {engine:.1f} ms, wrapper {wrapper:.1f} ms")
        for n in worker_counts:
            figures[f"scienceworld.steps_per_s.{n}"] = _throughput("scienceworld", sw_tasks, sw_paths,
                                                                   sw_kwargs, n, rounds)
            log(f"scienceworld: {n} workers: {figures[f'scienceworld.steps_per_s.{n}']:.1f} steps/s")

        alf_tasks = [f"gen:{t}:{i}" for i, t in enumerate(TASK_TYPES[: 1 if quick else 6])]
        alf_kwargs = {"game_dir": os.path.join(cache, "alfworld")}
        alf, alf_paths = _time_world("alfworld", alf_tasks, alf_kwargs, rounds, log)
        for k, v in alf.items():
            figures[f"alfworld.{k}"] = v
        log(f"alfworld: {alf}")
        for n in worker_counts:
            figures[f"alfworld.steps_per_s.{n}"] = _throughput(
                "alfworld", alf_tasks, alf_paths, alf_kwargs, n, rounds)
            log(f"alfworld: {n} workers: {figures[f'alfworld.steps_per_s.{n}']:.1f} steps/s")
    figures["cpu_count"] = float(os.cpu_count() or 0)
    return figures


def main(args: argparse.Namespace) -> int:
    return run_and_report(run, args)
