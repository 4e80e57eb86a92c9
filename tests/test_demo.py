"""``retrojax demo`` end to end, shrunk with --set overrides: every stage runs and leaves its outputs."""

import json

import numpy as np
import pytest

from retrojax import cli, config
from retrojax.agent.archive import Archive

# 3 test levels x 3 protocols = 9 sampler rows = 3 training tasks x 3 trials: one sampler shape throughout.
# One epoch of one minibatch: the update compiles one microbatch shape (the demo's 2 minibatches of 3 task
# trees took two, each its own gradient program); epochs and minibatches: tests/test_learner_learns.py.
# 4 calls a trial: model trials end on their call budget, fewer decode ticks per batch than the demo's 8.
SHRUNK = [
    "model.preset=tiny", "sft.steps=3", "sft.batch_size=4", "sft.seq_len=1024", "sft.vocab_size=1024",
    "sft.num_solver_episodes=6", "sft.num_recovery_episodes=6", "sft.oracle_epsilon=0.5",
    "learn.updates=1", "learn.tasks_per_update=3", "trial.trials_per_task=3", "learn.seq_buckets=[1024]",
    "eval.num_tasks=3", "sampler.max_len=1024", "sampler.chunk_buckets=[64]", "trial.max_calls=4",
    "learn.train_tasks=3", "eval.greedy=true", "learn.epochs=1", "learn.minibatches=1",
]


def test_demo_config_loads_and_sizes_its_batches_alike():
    cfg = config.load("configs/demo.yaml")
    rows_eval = cfg.eval.num_tasks * len(cfg.eval.protocols) * cfg.eval.seeds
    rows_train = cfg.learn.tasks_per_update * cfg.trial.trials_per_task
    # one sampler shape: an RL batch fills the max_inflight rows; evaluation streams through the same rows
    assert cfg.sampler.max_inflight == rows_train <= rows_eval
    assert cfg.trial.prompt_style == "compact" and cfg.sft.steps > 0 and cfg.learn.updates > 0


def test_demo_rejects_a_bad_override(capsys):
    assert cli.main(["demo", "--set", "sft.steps=many"]) == 2
    assert "sft.steps" in capsys.readouterr().err


def test_commands_refuse_settings_they_cannot_use_before_any_stage(monkeypatch, capsys):
    """A bad learn / sft / env value is named (all of them at once) with exit code 2 before demonstrations,
    SFT or RL start: before, `learn.epochs=0` surfaced after minutes of SFT and `env.num_tasks=0` crashed."""
    from retrojax import demo
    from retrojax.learn import cli as train_cli

    def no_stage(*args, **kwargs):
        raise AssertionError("a stage started")

    monkeypatch.setattr(demo, "run", no_stage)
    monkeypatch.setattr(train_cli, "build_model", no_stage)
    bad = ["learn.epochs=0", "sft.batch_size=-2", "sft.seq_len=1", "sft.oracle_epsilon=2", "env.num_tasks=0"]
    assert cli.main(["demo", *[a for s in bad[:4] for a in ("--set", s)]]) == 2
    out = capsys.readouterr().err
    assert all(f"{s.split('=')[0]} must" in out for s in bad[:4])
    assert cli.main(["demo", "--set", bad[4]]) == 2 and "env.num_tasks" in capsys.readouterr().err
    more = ["eval.seeds=0", "trial.history_events=-1", "sampler.max_new_tokens=0"]
    assert cli.main(["demo", *[a for s in more for a in ("--set", s)]]) == 2
    out = capsys.readouterr().err
    assert all(s.split("=")[0] in out for s in more)
    assert cli.main(["bench", "learn", "--set", "learn.updates=0"]) == 2
    assert "learn.updates must be ≥ 1" in capsys.readouterr().err
    assert cli.main(["bench", "learn", "--compare", "--set", "learn.minibatches=0"]) == 2
    assert "learn.minibatches" in capsys.readouterr().err
    train = ["train", "--config", "configs/sokoban_tiny.yaml", "--set", "sft.seq_len=0"]
    assert cli.main(train) == 2 and "sft.seq_len" in capsys.readouterr().err
    for bad_train in ("env.num_tasks=0", "sampler.max_new_tokens=0"):
        assert cli.main([*train[:3], "--set", bad_train]) == 2
        assert bad_train.split("=")[0] in capsys.readouterr().err


def test_the_demo_command_runs_the_demo_stack_on_its_config(monkeypatch, tmp_path, capsys):
    """``retrojax demo`` hands demo.run the config with the user's sets and prints where the report is (the
    stack itself runs below)."""
    from retrojax import demo

    seen = []
    monkeypatch.setattr(demo, "run", lambda cfg: seen.append(cfg) or tmp_path / "report.md")
    assert cli.main(["demo", "--set", f"run.out_dir={tmp_path}", "--set", "sft.steps=7"]) == 0
    assert len(seen) == 1 and seen[0].sft.steps == 7 and seen[0].run.out_dir == str(tmp_path)
    assert seen[0].env.split == config.load("configs/demo.yaml").env.split
    assert f"[demo] report: {tmp_path / 'report.md'}" in capsys.readouterr().out


@pytest.mark.slow
def test_shrunk_demo_runs_every_stage_and_bench_learn_writes_every_key(tmp_path):
    """The demo stack through ``retrojax bench learn --quick`` (one run serves both: the bench is the demo
    stack plus its figures): every stage's outputs, and every key the learn bench documents. It holds out
    the split's val part with a check after each update (``eval.held_out``, ``eval.every``): the tuning path;
    the default part, test, is the same code with another part name."""
    from test_bench_quick import KEYS, quick

    # the stop rule's pool check plays the RL pool through the real sampler after SFT steps 1 and 2
    stop = ["sft.stop_at_success=1.0", "sft.stop_at_levels=1.0", "sft.check_from=1", "sft.check_every=1"]
    out = tmp_path / "demo"
    sets = [*SHRUNK, *stop, "eval.protocols=[P@1,T@1,T@3]", "eval.seeds=1", "eval.held_out=val",
            "eval.every=1", "learn.updates=2", f"run.out_dir={out}"]  # two updates: the bench's two windows
    figures = quick("learn", tmp_path, *[a for s in sets for a in ("--set", s)])
    assert figures["learn.report"] == str(out / "report.md")
    assert [k for k in KEYS["learn"] if k not in figures] == []
    assert figures["learn.heldout.part"] == "val"
    assert [u for u, _ in figures["learn.heldout.checks"]] == [1, 2]

    summary = json.loads((out / "summary.json").read_text())
    for policy in ("SFT", "RL"):
        assert set(summary["results"][policy]) == {"P@1", "T@1", "T@3"}
        assert {p: r["n"] for p, r in summary["results_greedy"][policy].items()} == {
            "P@1": 3, "T@1": 3, "T@3": 3}  # eval.greedy: both policies again with greedy decoding
        for r in summary["results"][policy].values():
            assert r["n"] == 3 and 0.0 <= r["success"] <= 1.0 and r["ci95"][0] <= r["success"] <= r["ci95"][1]
    assert summary["sft"]["pack"]["own_tokens"] > 0 and np.isfinite(summary["sft"]["held_out_nll_after"])
    checks, steps = summary["sft"]["pool_checks"], summary["sft"]["steps"]
    assert [k for k, _, _ in checks] == list(range(1, steps if steps == 3 else steps + 1))
    assert all(0.0 <= v <= n <= 1.0 for _, v, n in checks)  # a trial solved means its level solved
    assert (steps == 3) == all(v < 1.0 for _, v, _ in checks)
    assert summary["demonstrations"]["recovery"]["trials"] == 6
    assert len(summary["curve"]) == 2 and all(0.0 <= p["success"] <= 1.0 for p in summary["curve"])
    # the final policy replayed update 1's 9 trials (the first window); "first" is their outcome in training
    replay = summary["replay_first_window"]
    assert replay["trials"] == 9 and replay["first"] == pytest.approx(summary["curve"][0]["success"])
    assert 0.0 <= replay["replay"] <= 1.0 and "replay first window" in summary["stages"]
    assert summary["train_tasks"] == 3  # RL's pool: the first 3 training levels
    assert summary["demonstrations"]["levels"] == 3  # demonstrations concentrate on the pool
    assert "context_only_moves" in summary["demonstrations"]["recovery"]
    point = summary["curve"][0]
    cfg = config.load("configs/demo.yaml", SHRUNK)
    steps_per_update = cfg.learn.epochs * cfg.learn.minibatches  # one AdamW step per minibatch per epoch
    assert 0.0 <= point["diag/mixed_groups"] <= 1.0
    assert 0.0 <= point["rollout/expert_first_move"] <= 1.0  # does the policy read the board?
    assert all(0.0 <= summary["heldout_expert_first_move"][k] <= 1.0 for k in ("SFT", "RL"))
    assert point["train/optimizer_steps"] in (0.0, steps_per_update)
    assert {tuple(x[:3]) for x in summary["heldout_trials"]["SFT"]} == {
        tuple(x[:3]) for x in summary["heldout_trials"]["RL"]}  # paired: same levels, seeds, protocols
    for stage in ("sft", "eval", "collect", "update"):  # compiled programs within each stage's bound
        needed = summary[f"programs.{stage}.compiled"] + summary[f"programs.{stage}.cached"]
        assert needed <= summary[f"programs.{stage}.bound"], stage

    report = (out / "report.md").read_text()
    assert "| SFT | T@3 |" in report and "| RL | P@1 |" in report and "Δref" in report
    assert "greedy decoding (temperature 0" in report
    assert "drawn from the first 3 training levels" in report
    assert "stopped at the first check where the policy solved ≥ 100% of the RL pool's trials" in report
    assert "## Per-update diagnostics" in report and "mixed groups" in report
    assert "Replaying the first window's 9 trials" in report
    for png in ("success_by_protocol.png", "learning_curve.png", "success_vs_attempts.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert any((out / "rl" / "checkpoints").iterdir())

    # the exported policy and its tokenizer load back and fit together
    from retrojax.model.checkpoint import from_pretrained
    from retrojax.model.tokenizer import load_tokenizer

    model = from_pretrained(out / "policy")
    tok = load_tokenizer(out / "policy")
    assert model.config.vocab_size >= tok.vocab_size and model.config.num_hidden_layers == 2

    # the demonstrations were recorded with that tokenizer: every id is in its vocabulary
    demos = Archive.load(out / "demonstrations.jsonl")
    assert demos.recoveries, "recovery play should have produced at least one recovery"
    top = max(int(np.max(np.concatenate([c.prompt_ids, c.output_ids]))) for c in demos.calls)
    assert top < tok.vocab_size
