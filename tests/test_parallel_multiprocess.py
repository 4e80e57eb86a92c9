"""Two local processes × 4 simulated devices (jax.distributed over gloo): the same training history as one
process, a 2-process checkpoint restored in one process, and an optimizer state with no host-local leaf."""

from __future__ import annotations

import numpy as np
import pytest

from retrojax.parallel.shares import agreed_plan, align, describe_local, task_share
from retrojax.parallel.testing import run_processes

COMMON = r"""
import numpy as np
from retrojax.agent.archive import Archive
from retrojax.config import from_dict
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.trainer import Trainer
from retrojax.model.build import build_model

def collect(model, tasks, seeds):
    # each task's trials follow from its own seed alone, wherever (on whichever process) it runs
    arch = Archive()
    offset = 0
    for task, seed in zip(tasks, seeds):
        one = synthetic_archive(np.random.default_rng(seed), tasks=1, trials=2, vocab=256, segments=2,
                                decisions=2, prompt_len=12, turn_len=4, output_len=5)
        for rec in [*one.calls, *one.segments, *one.recoveries, *one.trials]:
            rec.task, rec.trial = int(task), rec.trial + offset
        offset += len(one.trials)
        arch.calls += one.calls; arch.segments += one.segments
        arch.recoveries += one.recoveries; arch.trials += one.trials
    return arch, {"trials": float(len(arch.trials))}

def trainer(out_dir, mesh, extra=None):
    cfg = from_dict({
        "model": {"preset": "tiny"},
        "mesh": {"data": mesh[0], "fsdp": mesh[1], "tp": mesh[2]},
        # token-forest rows of one length (layout tree, one bucket): every update runs the programs of one
        # microbatch shape (tree_long cuts rows to many lengths, each a compile of its own)
        "learn": {"updates": 2, "tasks_per_update": 4, "seq_buckets": [40], "max_batch_tokens": 40 * 64,
                  "layout": "tree", "learning_rate": 1e-4, "logprob_chunk": 16, "check_logprobs": False},
        "eval": {"every": 0},
        "run": {"out_dir": str(out_dir), "seed": 7, "keep_checkpoints": 2},
        **(extra or {}),
    })
    return Trainer(cfg, build_model(cfg), collect=collect, evaluate=lambda model, it: {}, num_tasks=8,
                   tensorboard=False, progress=False)
"""

TWO = COMMON + r"""
import json, os, sys
import jax
from retrojax.parallel.distributed import setup
from retrojax.config import from_dict
setup(from_dict({"distributed": {"initialize": "on", "coordinator": os.environ["RETROJAX_COORDINATOR"],
                                 "num_processes": 2, "process_id": int(os.environ["RETROJAX_PROCESS_ID"]),
                                 "compile_cache": False}}))
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
tr = trainer(sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"], (2, 2, 2))
hist = tr.fit()
opt_global = all(not x.is_fully_addressable for x in jax.tree.leaves(tr.opt_state))
tr.close()
print(json.dumps({"pid": jax.process_index(), "loss": [h["train/loss"] for h in hist],
                  "grad_norm": [h["train/grad_norm"] for h in hist], "opt_global": opt_global}))
"""


def test_task_shares_keep_whole_groups_and_cover_everything():
    tasks, seeds = list(range(10, 17)), list(range(100, 107))
    shares = [task_share(tasks, seeds, p, 3) for p in range(3)]
    assert [t for s in shares for t in s[0]] == tasks and [x for s in shares for x in s[1]] == seeds
    assert max(len(s[0]) for s in shares) - min(len(s[0]) for s in shares) <= 1
    with pytest.raises(ValueError):
        task_share(tasks, seeds, 3, 3)


def _mb(rows, length, w):
    return {"input_ids": np.ones((rows, length), np.int32), "targets": np.ones((rows, length), np.int32),
            "attention_mask": np.ones((rows, length), bool),
            "old_logprobs": np.zeros((rows, length), np.float32),
            "adv": np.ones((rows, length), np.float32), "weight": np.full((rows, length), w, np.float32),
            "exec_mask": np.ones((rows, length), bool), "ref_mask": np.zeros((rows, length), bool)}


def test_processes_agree_on_microbatches_and_rescale_weights():
    # process 0: two chunks of length 32 and one of 64; process 1: one chunk of length 32 and one of 128
    a = [_mb(4, 32, 1.0), _mb(2, 32, 1.0), _mb(1, 64, 1.0)]
    b = [_mb(8, 32, 1.0), _mb(2, 128, 1.0)]
    gathered = np.stack([describe_local([x["input_ids"].shape for x in a], 3),
                         describe_local([x["input_ids"].shape for x in b], 1)])
    plan = agreed_plan(gathered)
    assert plan == [(32, 0, 8), (32, 1, 2), (64, 0, 1), (128, 0, 2)]
    got_a, got_b = align(a, 3, gathered, 1.0), align(b, 1, gathered, 2.0)
    assert [x["input_ids"].shape for x in got_a] == [x["input_ids"].shape for x in got_b] == [
        (8, 32), (2, 32), (1, 64), (2, 128)]
    # padding rows and missing chunks carry zero weight and no mask
    assert not got_a[3]["exec_mask"].any() and got_a[3]["weight"].sum() == 0
    assert not got_a[0]["exec_mask"][4:].any()
    # weights: (local tasks / all tasks) × (agreed steps / local steps); microbatch counts do not enter
    assert np.allclose(got_a[0]["weight"][:4], 3 / 4)
    assert np.allclose(got_b[0]["weight"], 1 / 4 * 2.0)


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    import jax

    results = run_processes(TWO.replace('sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"]',
                                        repr(str(tmp_path / "two"))), processes=2, devices_per_process=4)
    assert [r["pid"] for r in results] == [0, 1]
    assert all(r["opt_global"] for r in results)  # every optimizer leaf is a global array
    assert results[0]["loss"] == results[1]["loss"]  # both read the same replicated scalars

    ns: dict = {}
    exec(COMMON, ns)
    one = ns["trainer"](tmp_path / "one", (1, 1, 1))
    hist = one.fit()
    want = jax.tree.map(np.asarray, one.params)
    one.close()
    np.testing.assert_allclose(results[0]["loss"], [h["train/loss"] for h in hist], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(results[0]["grad_norm"], [h["train/grad_norm"] for h in hist], rtol=1e-5)
    assert not (tmp_path / "two" / "metrics.jsonl").exists() or len(
        (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()) == 2  # process 0 alone wrote it

    # the 2-process checkpoint restores in this one process and equals the one-process run
    again = ns["trainer"](tmp_path / "two", (1, 1, 1))
    assert again.restore()
    assert again.iteration == 2
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, atol=1e-5)
    again.close()



@pytest.mark.parametrize("raw, want", [("on", True), ("off", False), ("true", True), ("auto", False)])
def test_initialize_accepts_the_readme_spelling(raw, want):
    """``--set distributed.initialize=on`` reaches the config as YAML's bool; it means the same as "on"."""
    from retrojax.config import load
    from retrojax.parallel.distributed import wants_initialize

    cfg = load("configs/sokoban_tiny.yaml", [f"distributed.initialize={raw}"])
    assert wants_initialize(cfg.distributed, {}) is want
