"""Every ``retrojax bench`` target in its ``--quick`` form, through the real CLI entry: each runs its real
code path at tiny shapes and writes every key its module documents, numbers finite. Speed is not asserted
(the figures live in the bench commands, on an idle machine); a command that crashes or loses a key fails."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from retrojax.cli import main as cli

B = (1, 64, 1024, 4096)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
PLAN = ("model", "dtype", "remat", "batch_rows", "tokens", "compile.s", "params_per_device_bytes",
        "opt_per_device_bytes", "activations_per_device_bytes", "update_args_per_device_bytes",
        "kv_cache_trials", "kv_cache_per_device_bytes", "kv_cache_total_bytes", "train_peak_per_device_bytes",
        "rollout_per_device_bytes", "device_bytes", "fits_train", "fits_rollout")
LAYOUTS = ("rows", "tree", "tree_long")
LAYOUT_KEYS = ("positions_per_trained_token", "unique_token_ratio", "s", "cpu_s", "programs",
               "attention_pairs_per_trained_token")

KEYS: dict[str, list[str]] = {
    "envs": [f"{world}.{k}" for world in ("sokoban", "minesweeper")
             for k in (*(f"steps_per_s.{b}" for b in B), "rewind_us_per_trial",
                       "deepcopy_rewind_us_per_trial")]
    + ["sokoban.generate_s_per_level", "sokoban.solve_ms_per_state", "minesweeper.generate_s_per_board"],
    "sampler": [f"{p}{k}" for p in ("", "wide.") for k in (
        "decode_tok_per_s.1", "decode_tok_per_s.32", "hf_decode_tok_per_s.1", "hf_decode_tok_per_s.32",
        "long_decode_tok_per_s.32")]
    + [f"multiturn.{k}" for k in ("prefill_tokens.rewind", "prefill_tokens.reprefill", "wall_s.rewind",
                                  "wall_s.reprefill", "prefill_ratio", "wall_ratio")],
    "update": ["update.s", "fwd_bwd.s", "update_over_fwd_bwd", "update_over_fwd_bwd.rows",
               "update_over_fwd_bwd.tree_long", "update.lora_over_full", "update.lora_trainable_fraction"]
    + [f"update.{a}.{lay}.{k}" for a in ("demo", "paper") for lay in LAYOUTS for k in LAYOUT_KEYS]
    + [f"update.{a}.{k}" for a in ("demo", "paper")
       for k in ("speedup", "speedup_long", "cpu_speedup", "cpu_speedup_long", "attention_pairs_ratio")]
    + [f"sft.{lay}.{k}" for lay in LAYOUTS for k in ("positions_per_trained_token", "s")],
    "textworlds": [f"scienceworld.step_ms.{k}" for k in ("bridge", "engine", "wrapper")]
    + [f"{w}.{k}" for w in ("scienceworld", "alfworld") for k in ("reset_ms", "rewind_ms_per_action")]
    + [f"{w}.steps_per_s.{n}" for w in ("scienceworld", "alfworld") for n in (1, 2)] + ["alfworld.step_ms"],
    "serve": [f"serve.tok_per_s.{n}" for n in (1, 8, 32)]
    + ["serve.sequential_tok_per_s", "serve.speedup_32", "serve.compile_s", "serve.programs",
       "serve.programs_while_measuring"]
    + [f"serve.engine.{k}" for k in ("decode_calls", "max_running", "joined_running_batch",
                                     "prefix_reused_tokens")],
    "learn": ["learn.recipe", "learn.updates", "learn.wall_s", "learn.rl_wall_s", "learn.window_updates",
              "learn.sft.steps", "learn.curve", "learn.success.replay_change"]
    + [f"learn.success.{w}{s}" for w in ("first", "last", "replay") for s in ("", ".ci95_lo", ".ci95_hi")]
    + [f"learn.{g}_groups.{w}" for g in ("mixed", "solved", "failed") for w in ("first", "last")]
    + [f"learn.expert_first_move.{w}" for w in ("first", "last")]
    + [f"learn.heldout.{p}.T@3{s}" for p in ("sft", "rl", "rl_minus_sft")
       for s in ("", ".ci95_lo", ".ci95_hi")]
    + [f"learn.heldout.{p}.expert_first_move" for p in ("sft", "rl")]
    + ["learn.heldout.part", "learn.heldout.checks"],
    "parallel": ["parallel.update_flops_per_device_ratio", "parallel.update_bytes_per_device_ratio",
                 "parallel.decode_weight_allgathers", "update.mem.params_per_device_bytes",
                 "update.mem.opt_per_device_bytes", "update.mem.temp_per_device_bytes",
                 "decode.kv_cache_per_device_bytes", "update_compile_1dev.s", "update_compile_mesh.s",
                 "update.traces_3_steps_2_buckets"]
    + [f"{k}.{op}.{m}" for k in ("update", "decode", "decode_train_profile") for op in COLLECTIVES
       for m in ("count", "bytes")]
    + [f"{p}.{k}" for p in ("plan", "plan_remat") for k in PLAN],
    "lora": ["decode.merged.tokens_per_s", "decode.per_step.tokens_per_s", "decode.merged_over_per_step"],
    "credit": ["credit.success"] + [f"credit.groups.{g}" for g in ("failed", "mixed", "solved")]
    + [f"credit.{s}.{r}.{g}.{k}.n" for s in ("reward", "progress") for r in ("segment", "resumed")
       for g in ("failed", "mixed", "solved") for k in ("move_best", "move_other", "rewind", "invalid")],
}


def quick(target: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    """``retrojax bench TARGET --quick --json F`` in this process; the figures it wrote."""
    out = tmp_path / f"{target}.json"
    assert cli(["bench", target, "--quick", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def numbers(value: Any) -> list[float]:
    if isinstance(value, bool) or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    return [x for item in value for x in numbers(item)]


# learn: in tests/test_demo.py, whose shrunk demo runs through `bench learn --quick` (one run, both checks)
@pytest.mark.parametrize("target", [t for t in KEYS if t not in ("textworlds", "learn")])
def test_quick_run_writes_every_documented_key(target, tmp_path):
    figures = quick(target, tmp_path)
    assert [k for k in KEYS[target] if k not in figures] == []
    assert [k for k, v in figures.items() if not all(math.isfinite(x) for x in numbers(v))] == []


@pytest.mark.textworlds
def test_quick_textworlds_writes_every_documented_key(tmp_path):
    figures = quick("textworlds", tmp_path)
    assert [k for k in KEYS["textworlds"] if k not in figures] == []
    assert [k for k, v in figures.items() if not all(math.isfinite(x) for x in numbers(v))] == []
