"""Learning curves from the trainer's history: per-update points and a first-vs-last window comparison.

Host-side bookkeeping shared by the demo's report and ``retrojax bench learn`` (which read the same
``summary.json`` curve).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retrojax.eval import report

# Per-update diagnostics carried into the curve (the trainer logs them; see retrojax.learn.diagnostics).
DIAGNOSTICS = ("rollout/expert_first_move", "diag/mixed_groups", "diag/solved_groups", "diag/failed_groups",
               "diag/adv/move", "diag/adv/rewind", "diag/adv/invalid", "diag/adv/reflection",
               "diag/best_move_share", "diag/adv/move_best", "diag/adv/move_other",
               "diag/adv_failed/move_best", "diag/adv_failed/move_other",
               "train/approx_kl", "diag/kl_ref", "train/entropy_est", "rollout/invalid",
               "train/optimizer_steps")


def learning_curve(history: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per update: training-batch success and trials, reward, held-out success, and cumulative wall time."""
    curve, wall = [], 0.0
    for h in history:
        wall += float(h.get("time/collect_s", 0.0)) + float(h.get("time/learn_s", 0.0))
        curve.append({"update": int(h["iteration"]), "success": h.get("rollout/success", float("nan")),
                      "trials": int(h.get("rollout/trials", 0)), "reward": h.get("rollout/return"),
                      "eval_success": h.get("eval/success"), "wall_s": wall,
                      **{k: h[k] for k in DIAGNOSTICS if k in h}})
    return curve


def pool_window(train_tasks: int | None, tasks_per_update: int, minimum: int = 2) -> int:
    """Updates per first/last window: at least ``minimum`` and at least one pass over a fixed training pool
    (``train_tasks / tasks_per_update`` updates), so both windows hold every pool level — equally often when
    the run is a whole number of passes. Fresh levels every update (no pool): ``minimum``."""
    if not train_tasks or tasks_per_update < 1:
        return minimum
    return max(minimum, -(-int(train_tasks) // int(tasks_per_update)))


def batch_success_change(curve: Sequence[dict[str, Any]], window: int = 2) -> dict[str, Any] | None:
    """Training-batch success of the first vs the last ``window`` updates (fewer when the run is short, so
    the two windows never share an update), pooled over their trials, with Wilson 95% intervals."""
    from retrojax.eval.metrics import wilson

    n = len(curve)
    w = min(window, n // 2)
    if w < 1:
        return None

    def pooled(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
        trials = sum(int(p["trials"]) for p in points)
        wins = int(round(sum(float(p["success"]) * int(p["trials"]) for p in points)))
        rate = wins / trials if trials else float("nan")
        return {"success": rate, "trials": trials, "ci95": list(wilson(wins, trials)),
                "updates": [int(p["update"]) for p in points]}

    first, last = pooled(curve[:w]), pooled(curve[-w:])
    return {"first": first, "last": last, "change": last["success"] - first["success"],
            "overlap": report.intervals_overlap(first["ci95"], last["ci95"])}


def replay_change(before: Sequence[bool], after: Sequence[bool]) -> dict[str, Any] | None:
    """The first window's trials (``before``: their outcomes in training) against the final policy replaying
    the same specs (``after``: same levels, env seeds and replicates, in the same order): both rates with
    Wilson intervals and the paired difference with its 95% interval. None without trials.

    Fresh levels every update make the first and last windows differ in the levels drawn as much as in the
    policy; the replay holds the levels fixed, so its change is the policy's (and the sampling noise the
    interval carries)."""
    from retrojax.eval.metrics import paired_difference, wilson

    if len(before) != len(after):
        raise ValueError(f"replay_change needs paired outcomes, got {len(before)} and {len(after)}")
    if not before:
        return None
    n, wins_before, wins_after = len(before), int(sum(map(bool, before))), int(sum(map(bool, after)))
    d, lo, hi = paired_difference(list(after), list(before))
    return {"first": wins_before / n, "first_ci95": list(wilson(wins_before, n)),
            "replay": wins_after / n, "replay_ci95": list(wilson(wins_after, n)),
            "change": d, "change_ci95": [lo, hi], "trials": n}


def replay_note(replay: dict[str, Any] | None) -> str | None:
    """One sentence on the replay of the first window (None without one)."""
    if replay is None:
        return None
    lo, hi = replay["change_ci95"]
    support = "the interval holds 0" if lo <= 0.0 <= hi else "the interval excludes 0"
    return (f"Replaying the first window's {replay['trials']} trials (same levels, seeds and replicates) "
            f"with the final policy: {replay['first']:.1%} {report.fmt_ci(replay['first_ci95'])} in training "
            f"→ {replay['replay']:.1%} {report.fmt_ci(replay['replay_ci95'])} now, paired "
            f"{100 * replay['change']:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]; {support}. This "
            "change is the policy's on fixed levels; the first-vs-last windows above also differ in the "
            "levels drawn.")


def _updates_text(updates: Sequence[int]) -> str:
    return f"update {updates[0]}" if len(updates) == 1 else f"updates {updates[0]}-{updates[-1]}"


def batch_success_note(change: dict[str, Any] | None) -> str:
    """One sentence: did training-batch success rise, with intervals."""
    if change is None:
        return "Training-batch success: too few updates to compare a first and a last window."
    f, la = change["first"], change["last"]
    verdict = "rose" if change["change"] > 0 else ("did not change" if change["change"] == 0 else "fell")
    support = ("the 95% intervals overlap, so the change is not statistically supported"
               if change["overlap"] else "the 95% intervals do not overlap")
    return (f"Training-batch success {verdict}: {f['success']:.1%} {report.fmt_ci(f['ci95'])} over "
            f"{_updates_text(f['updates'])} ({f['trials']} trials) → {la['success']:.1%} "
            f"{report.fmt_ci(la['ci95'])} over {_updates_text(la['updates'])} ({la['trials']} trials); "
            f"{support}.")




def diagnostics_table(curve: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the per-update diagnostics (success, group composition, mean advantage by decision
    kind, KL to the behaviour and reference policies, entropy, invalid turns, optimizer steps)."""
    cols = [("success", "success", "{:.0%}"), ("expert 1st move", "rollout/expert_first_move", "{:.0%}"),
            ("mixed groups", "diag/mixed_groups", "{:.0%}"),
            ("all solved", "diag/solved_groups", "{:.0%}"), ("all failed", "diag/failed_groups", "{:.0%}"),
            ("A move", "diag/adv/move", "{:+.2f}"), ("best moves", "diag/best_move_share", "{:.0%}"),
            ("A best move", "diag/adv/move_best", "{:+.2f}"),
            ("A other move", "diag/adv/move_other", "{:+.2f}"),
            ("A best, failed", "diag/adv_failed/move_best", "{:+.2f}"),
            ("A other, failed", "diag/adv_failed/move_other", "{:+.2f}"),
            ("A rewind", "diag/adv/rewind", "{:+.2f}"),
            ("A invalid", "diag/adv/invalid", "{:+.2f}"), ("A reflection", "diag/adv/reflection", "{:+.2f}"),
            ("KL behaviour", "train/approx_kl", "{:.4f}"), ("KL ref", "diag/kl_ref", "{:.4f}"),
            ("entropy", "train/entropy_est", "{:.3f}"), ("invalid/trial", "rollout/invalid", "{:.2f}"),
            ("steps", "train/optimizer_steps", "{:.0f}")]

    def cell(p: dict[str, Any], key: str, fmt: str) -> str:
        v = p.get(key)
        return "–" if v is None or v != v else fmt.format(float(v))  # v != v: NaN (no such decision)

    head = "| update | " + " | ".join(c[0] for c in cols) + " |"
    rule = "|---:|" + "---:|" * len(cols)
    rows = [f"| {p['update']} | " + " | ".join(cell(p, k, f) for _, k, f in cols) + " |" for p in curve]
    return "\n".join([head, rule, *rows])
