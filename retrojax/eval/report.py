"""A run's markdown report and its PNG plots (matplotlib, Agg backend, no display needed).

Inputs are plain data so any run (the demo, a training job, an eval sweep) can write one:

- ``results``: ``{policy: {protocol: {"success": p, "ci95": [lo, hi], "calls": c, "rewinds": r, ...}}}`` —
  the keys of ``retrojax eval --json``'s ``results.<protocol>`` entries, one mapping per policy
  (e.g. ``"SFT"`` and ``"RL"``);
- ``curve``: one mapping per RL update with at least ``"update"`` and ``"success"`` (the training batch's
  success rate), optionally ``"reward"`` and evaluation points ``"eval_success"``;
- ``attempts``: ``{policy: [success within 1, 2, …, K macro-attempts]}`` (see ``success_within_attempts``).

Plots: success by protocol for each policy (bars with 95% intervals), the RL learning curve, and success vs
the number of macro-attempts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

Results = Mapping[str, Mapping[str, Mapping[str, Any]]]


def success_within_attempts(trials: Iterable[Any], max_attempts: int) -> list[float]:
    """Fraction of trials solved using at most k macro-attempts, for k = 1..max_attempts.

    ``trials`` are records with ``success`` and ``macro_attempts`` (e.g. ``archive.TrialRecord``) from a
    protocol that allows ``max_attempts`` macro-attempts, so the curve is non-decreasing and ends at that
    protocol's success rate.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    trials = list(trials)
    if not trials:
        raise ValueError("no trials to summarize")
    return [sum(bool(t.success) and int(t.macro_attempts) <= k for t in trials) / len(trials)
            for k in range(1, max_attempts + 1)]


def _fmt_pct(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def fmt_ci(ci: Sequence[float] | None) -> str:
    if not ci or len(ci) != 2:
        return "–"
    return f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _fmt_num(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _protocols(results: Results) -> list[str]:
    seen: list[str] = []
    for per_policy in results.values():
        for proto in per_policy:
            if proto not in seen:
                seen.append(proto)
    return seen


def deltas(per_protocol: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Δpro = T@1 − P@1 and Δref = T@3 − T@1 (whichever the protocols present allow)."""
    s = {p: float(r["success"]) for p, r in per_protocol.items()}
    out: dict[str, float] = {}
    if "T@1" in s and "P@1" in s:
        out["Δpro"] = s["T@1"] - s["P@1"]
    if "T@3" in s and "T@1" in s:
        out["Δref"] = s["T@3"] - s["T@1"]
    return out


def results_table(results: Results) -> str:
    """Markdown table: one row per (policy, protocol)."""
    lines = ["| policy | protocol | success | 95% interval | trials | calls / trial | rewinds / trial |",
             "|---|---|---:|---|---:|---:|---:|"]
    for policy, per_protocol in results.items():
        for proto, r in per_protocol.items():
            lines.append(
                f"| {policy} | {proto} | {_fmt_pct(r.get('success'))} | {fmt_ci(r.get('ci95'))} | "
                f"{_fmt_num(r.get('n'))} | {_fmt_num(r.get('calls'))} | {_fmt_num(r.get('rewinds'))} |")
    return "\n".join(lines)


def deltas_table(results: Results) -> str:
    lines = ["| policy | Δpro = T@1 − P@1 | Δref = T@3 − T@1 |", "|---|---:|---:|"]
    for policy, per_protocol in results.items():
        d = deltas(per_protocol)
        lines.append(f"| {policy} | {_signed_pct(d.get('Δpro'))} | {_signed_pct(d.get('Δref'))} |")
    return "\n".join(lines)


def _signed_pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.1f} pts"


def intervals_overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    return not (a[1] < b[0] or b[1] < a[0])


def compare_sentence(results: Results, before: str, after: str, protocol: str,
                     paired: Sequence[float] | None = None) -> str:
    """One honest sentence comparing two policies on one protocol.

    ``paired``: (mean, lo, hi) of ``after − before`` over the trials both played on the same levels and seeds
    (``eval.metrics.paired_outcomes``, its interval clustered by level). When given, its interval decides:
    two policies scored on the same trials differ with less noise than their separate intervals suggest."""
    try:
        ra, rb = results[before][protocol], results[after][protocol]
    except KeyError:
        return f"No {protocol} results for both {before} and {after}."
    sa, sb = float(ra["success"]), float(rb["success"])
    diff = sb - sa
    verdict = "improved on" if diff > 0 else ("matched" if diff == 0 else "did worse than")
    ci_a, ci_b = ra.get("ci95"), rb.get("ci95")
    if paired is not None:
        mean, lo, hi = (100 * float(x) for x in paired)
        support = (f"paired by level and seed, {mean:+.1f} pts [{lo:+.1f}, {hi:+.1f}] clustered by level: "
                   + ("an interval that excludes 0" if lo > 0 or hi < 0 else
                      "the interval includes 0, so this difference is not statistically supported"))
    elif ci_a and ci_b:
        support = ("the 95% intervals overlap, so this difference is not statistically supported"
                   if intervals_overlap(ci_a, ci_b) else "the 95% intervals do not overlap")
    else:
        support = "no intervals were given"
    return (f"On {protocol}, {after} {verdict} {before}: {_fmt_pct(sb)} vs {_fmt_pct(sa)} "
            f"({100 * diff:+.1f} pts); {support}.")


# ---------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------


def plot_success_by_protocol(results: Results, path: str | Path) -> Path:
    """Grouped bars: protocols on x, one bar per policy, 95% intervals as error bars."""
    path = Path(path)
    protocols = _protocols(results)
    policies = list(results)
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, policy in enumerate(policies):
        xs, ys, lo, hi = [], [], [], []
        for j, proto in enumerate(protocols):
            r = results[policy].get(proto)
            if r is None:
                continue
            s = float(r["success"])
            ci = r.get("ci95") or (s, s)
            xs.append(j + (i - (len(policies) - 1) / 2) * width)
            ys.append(s)
            lo.append(max(0.0, s - float(ci[0])))
            hi.append(max(0.0, float(ci[1]) - s))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=policy)
    ax.set_xticks(range(len(protocols)), protocols)
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate")
    ax.set_title("Success by protocol (95% intervals)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_learning_curve(curve: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Training-batch success (and mean return if given) per RL update; evaluation points as markers."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if curve:
        xs = [int(c["update"]) for c in curve]
        ax.plot(xs, [float(c["success"]) for c in curve], marker="o", ms=3, label="training trials: success")
        evals = [(int(c["update"]), float(c["eval_success"]))
                 for c in curve if c.get("eval_success") is not None]
        if evals:
            ax.plot(*zip(*evals, strict=True), "s--", label="held-out eval: success")
        if any(c.get("reward") is not None for c in curve):
            ax2 = ax.twinx()
            pts = [(int(c["update"]), float(c["reward"])) for c in curve if c.get("reward") is not None]
            ax2.plot(*zip(*pts, strict=True), color="tab:gray", alpha=0.6, label="mean return")
            ax2.set_ylabel("mean return per trial")
            ax2.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no RL updates were run", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RL update")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.set_title("ReTRAIL learning curve")
    if curve:
        ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_success_vs_attempts(attempts: Mapping[str, Sequence[float]], path: str | Path) -> Path:
    """Success within k macro-attempts, k = 1..K, one line per policy."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for policy, ys in attempts.items():
        ax.plot(range(1, len(ys) + 1), list(ys), marker="o", label=policy)
    k = max((len(v) for v in attempts.values()), default=1)
    ax.set_xticks(range(1, k + 1))
    ax.set_xlabel("macro-attempts allowed")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.set_title("Success vs number of macro-attempts")
    if attempts:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------


def write_report(out_dir: str | Path, *, title: str, results: Results,
                 curve: Sequence[Mapping[str, Any]] = (),
                 attempts: Mapping[str, Sequence[float]] | None = None,
                 facts: Mapping[str, Any] | None = None, stages: Sequence[tuple[str, float]] = (),
                 comparisons: Sequence[tuple[str, str, str]] = (), notes: Sequence[str] = (),
                 paired: Mapping[tuple[str, str, str], Sequence[float]] | None = None) -> Path:
    """Write ``report.md`` and its plots into ``out_dir``; returns the report's path.

    ``comparisons``: (before, after, protocol) triples, each turned into one sentence with its verdict
    (``paired``: their paired differences where the two policies played the same trials).
    ``facts``: key/value lines (model size, data, budgets). ``stages``: (name, seconds) wall times.
    """
    if not results:
        raise ValueError("write_report needs at least one policy's results")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "success_by_protocol.png": plot_success_by_protocol(results, out / "success_by_protocol.png"),
        "learning_curve.png": plot_learning_curve(curve, out / "learning_curve.png"),
    }
    if attempts:
        plots["success_vs_attempts.png"] = plot_success_vs_attempts(attempts, out / "success_vs_attempts.png")

    md = [f"# {title}", ""]
    if facts:
        md += ["## Setup", ""] + [f"- **{k}**: {v}" for k, v in facts.items()] + [""]
    md += ["## Results on the held-out split", "", results_table(results), "", deltas_table(results), ""]
    if comparisons:
        md += [f"- {compare_sentence(results, *c, paired=(paired or {}).get(tuple(c)))}"
               for c in comparisons] + [""]
    md += ["![success by protocol](success_by_protocol.png)", ""]
    md += ["## RL learning curve", ""]
    if curve:
        first, last = curve[0], curve[-1]
        md += [f"{len(curve)} updates; training-batch success {_fmt_pct(float(first['success']))} at update "
               f"{first['update']} → {_fmt_pct(float(last['success']))} at update {last['update']}.", ""]
    else:
        md += ["No RL updates were run.", ""]
    md += ["![learning curve](learning_curve.png)", ""]
    if attempts:
        md += ["## Success vs macro-attempts", "", "| policy | " + " | ".join(
            f"≤{k}" for k in range(1, max(len(v) for v in attempts.values()) + 1)) + " |",
            "|---|" + "---:|" * max(len(v) for v in attempts.values())]
        md += [f"| {p} | " + " | ".join(_fmt_pct(x) for x in ys) + " |" for p, ys in attempts.items()]
        md += ["", "![success vs attempts](success_vs_attempts.png)", ""]
    if stages:
        total = sum(s for _, s in stages)
        md += ["## Wall time", "", "| stage | seconds |", "|---|---:|"]
        md += [f"| {name} | {sec:.1f} |" for name, sec in stages] + [f"| **total** | {total:.1f} |", ""]
    if notes:
        md += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path
