"""Checkpoints across meshes and a real SIGKILL mid-update: resume continues as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from retrojax.learn.checkpoint import TrainCheckpoints
from retrojax.parallel.testing import run_snippet, simulated_env

# A Trainer over the tiny preset and a deterministic collector, on the mesh given by (data, fsdp, tp).
TRAINER = r"""
import numpy as np
from retrojax.config import from_dict
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.trainer import Trainer
from retrojax.model.build import build_model

def collect(model, tasks, seeds):
    arch = synthetic_archive(np.random.default_rng(list(seeds)), tasks=len(tasks), trials=2,
                             vocab=256, segments=2, decisions=2, prompt_len=12, turn_len=4, output_len=5)
    for rec in [*arch.calls, *arch.segments, *arch.recoveries, *arch.trials]:
        rec.task = int(tasks[rec.task])
    return arch, {"trials": float(len(arch.trials))}

def trainer(out_dir, mesh, updates=2, collect=collect):
    cfg = from_dict({
        "model": {"preset": "tiny"},
        "mesh": {"data": mesh[0], "fsdp": mesh[1], "tp": mesh[2]},
        "learn": {"updates": updates, "tasks_per_update": 2, "seq_buckets": [40], "max_batch_tokens": 40 * 8,
                  "learning_rate": 1e-4, "logprob_chunk": 16, "check_logprobs": False},
        "eval": {"every": 0},
        "distributed": {"compile_cache": False},
        "run": {"out_dir": str(out_dir), "seed": 5, "keep_checkpoints": 3},
    })
    return Trainer(cfg, build_model(cfg), collect=collect, evaluate=lambda model, it: {}, num_tasks=6,
                   tensorboard=False, progress=False)

def params_of(tr):
    import jax
    return [np.asarray(jax.device_get(x)).tolist() for x in jax.tree.leaves(tr.params)]
"""

CROSS_MESH = TRAINER + r"""
import json, shutil, sys
from pathlib import Path
root = Path(sys.argv[1])
ref = trainer(root / "ref", (1, 1, 1)); ref.fit(); want = params_of(ref); ref.close()
one_device = (ref.update, ref.logprobs)  # the one-device resume reuses the reference's compiled update
first = trainer(root / "a", (2, 2, 2)); first.fit(1); first.close()
shutil.copytree(root / "a", root / "b")
from retrojax.learn.checkpoint import TrainCheckpoints
out = {"meta_mesh": TrainCheckpoints(root / "a" / "checkpoints").meta(1).get("mesh")}
for name, mesh in (("a", (1, 4, 2)), ("b", (1, 1, 1))):
    tr = trainer(root / name, mesh)
    if mesh == (1, 1, 1):
        tr.update, tr.logprobs = one_device
    tr.fit(resume=True)
    got = params_of(tr)
    out[name] = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(got, want))
    out[name + "_iter"] = tr.iteration
    tr.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_resume_across_meshes_matches_one_device(tmp_path):
    r = run_snippet(CROSS_MESH, devices=8, args=[str(tmp_path)])
    assert r["meta_mesh"]["shape"] == [2, 2, 2] and r["meta_mesh"]["axes"] == ["data", "fsdp", "tp"]
    assert r["a_iter"] == 2 and r["b_iter"] == 2
    assert r["a"] <= 1e-5  # written on (2,2,2), continued on (1,4,2)
    assert r["b"] <= 1e-5  # written on (2,2,2), continued on one device


KILLED = TRAINER + r"""
import sys, time
from pathlib import Path
root = Path(sys.argv[1])

def slow_collect(model, tasks, seeds):
    out = collect(model, tasks, seeds)
    if tr.iteration == 2:
        (root / "in_update_3").write_text("1")
        time.sleep(600)  # SIGKILLed here, in the middle of update 3
    return out

tr = trainer(root / "run", (1, 1, 1), updates=4, collect=slow_collect)
tr.fit()
"""


@pytest.mark.slow
def test_sigkill_mid_update_resumes_from_the_last_complete_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], env=simulated_env(1),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while not (tmp_path / "in_update_3").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.time() < deadline
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert TrainCheckpoints(ckpt_dir).all_steps() == [1, 2]
    # a half-written step (orbax's temporary directory of a save that never finished) is never picked up
    partial = ckpt_dir / "3.orbax-checkpoint-tmp-1234567890"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "garbage").write_bytes(b"\0" * 64)
    assert TrainCheckpoints(ckpt_dir).latest_step() == 2

    ns: dict = {}
    exec(TRAINER, ns)
    resumed = ns["trainer"](tmp_path / "run", (1, 1, 1), updates=4)
    hist = resumed.fit(resume=True)
    got = ns["params_of"](resumed)
    resumed.close()
    ref = ns["trainer"](tmp_path / "ref", (1, 1, 1), updates=4)
    ref.update, ref.logprobs = resumed.update, resumed.logprobs  # one compile of the update for both runs
    want_hist = ref.fit()
    want = ns["params_of"](ref)
    ref.close()
    assert [h["iteration"] for h in hist] == [1.0, 2.0, 3.0, 4.0]  # lost only update 3, redone
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [h["train/loss"] for h in hist] == [h["train/loss"] for h in want_hist]
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in log] == [1.0, 2.0, 3.0, 4.0]
