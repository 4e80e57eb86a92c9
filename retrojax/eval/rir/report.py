"""``retrojax rir``: the paper-style RIR report — Table 1 (SR per world, DR, Avg SR), Table 2 (rollbacks
per task), Table 3 (when / where / components variants with SR, DR, steps, reviews, rollbacks, auxiliary
calls), the (L_min, L_max) range heat map (PNG) — with the paper's anchor numbers beside ours, marked as
the paper's. Every world's variants run as ONE paired batch (same tasks, seeds, replicates); ReTRAIL's
protocols run on the same tasks for the main table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from retrojax import config as config_lib
from retrojax.eval.protocol import evaluate, make_policy, open_transcripts, plan_policy_rows
from retrojax.eval.rir import metrics
from retrojax.eval.rir.run import format_eval

__all__ = ["build_report", "format_eval", "main", "protocols_for", "run_world"]

TABLES = ("main", "when", "where", "components", "range")
BASELINES = ("RIR/self-refine", "RIR/reflexion", "RIR/lats", "RIR/ga-rollback")  # the paper's §5.1
MAIN = ("RIR/react", *BASELINES, "RIR/no-rollback", "RIR/restart", "RIR")
WHEN = ("RIR/agent-only", "RIR/scheduled-only", "RIR/hybrid-fixed", "RIR")
WHERE = ("RIR/no-rollback", "RIR/restart", "RIR/direct", "RIR")
COMPONENTS = ("RIR/no-rollback", "RIR/rollback-only", "RIR")
RETRAIL = ("P@1", "T@1", "T@3")
LABELS = {
    "RIR/react": "ReAct (no recovery)",
    "RIR/self-refine": "Self-Refine",
    "RIR/reflexion": "Reflexion",
    "RIR/lats": "LATS",
    "RIR/ga-rollback": "GA-Rollback",
    "RIR/no-rollback": "Reflection only (no rollback)",
    "RIR/restart": "Restart",
    "RIR/direct": "Direct selection",
    "RIR/rollback-only": "Rollback only",
    "RIR/agent-only": "Agent-only review",
    "RIR/scheduled-only": "Scheduled-only review",
    "RIR/hybrid-fixed": "Hybrid (fixed)",
    "RIR": "RIR (hybrid, adaptive)",
    "P@1": "ReTRAIL P@1",
    "T@1": "ReTRAIL T@1",
    "T@3": "ReTRAIL T@3",
}
# The paper's anchors (ScienceWorld, DeepSeek-V3), shown beside ours and marked as the paper's.
PAPER = {
    "RIR": {"success": 0.7675, "dense_reward": 0.813, "steps": 42.4, "rollbacks": 0.92},
    "RIR/range-2-8": {"success": 0.7749, "rollbacks": 0.77},
}
PAPER_NOTE = "paper: ScienceWorld, DeepSeek-V3 (their numbers, not ours)"


def protocols_for(tables: list[str], cfg: Any) -> list[str]:
    out: list[str] = []
    groups = {"main": MAIN, "when": WHEN, "where": WHERE, "components": COMPONENTS, "range": ("RIR",)}
    for t in tables:
        for p in groups[t]:
            if p not in out:
                out.append(p)
    if "range" in tables:
        for lo in cfg.rir.range_l_min:
            for hi in cfg.rir.range_l_max:
                if lo <= hi:
                    name = f"RIR/range-{lo}-{hi}"
                    if name not in out:
                        out.append(name)
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def _row(name: str, r: dict[str, Any] | None, fields: list[str]) -> str:
    if r is None:
        return ""
    cells = [LABELS.get(name, name)]
    for f in fields:
        v = r.get(f)
        if f == "success":
            lo, hi = r.get("ci95", [None, None])
            cells.append(f"{_pct(v)} [{_pct(lo)}, {_pct(hi)}]" if lo is not None else _pct(v))
        elif v is None:
            cells.append("–")
        else:
            cells.append(f"{v:.3f}" if f == "dense_reward" else f"{v:.2f}")
    return "| " + " | ".join(cells) + " |"


def _variant_table(title: str, worlds: dict[str, dict[str, Any]], names: tuple[str, ...]) -> list[str]:
    fields = ["success", "dense_reward", "steps", "actions", "reviews", "rollbacks", "aux_calls"]
    head = "| variant | SR [95% CI] | DR | steps | actions | reviews | rollbacks | aux calls |"
    out = [f"## {title}", ""]
    for world, data in worlds.items():
        out += [f"### {world} ({data['split']})", "", head, "|" + "---|" * 8]
        out += [_row(n, data["results"].get(n), fields) for n in names if n in data["results"]]
        out.append("")
    p = PAPER["RIR"]
    out += [
        f"{PAPER_NOTE}: RIR {_pct(p['success'])} SR, DR {p['dense_reward']:.3f}, {p['steps']:.1f} steps, "
        f"{p['rollbacks']:.2f} rollbacks per task.",
        "",
    ]
    return out


def _model_facts(worlds: dict[str, dict[str, Any]]) -> list[str]:
    """Paired differences against RIR's ablations, parse failures per auxiliary role, refused restores, the
    model rows' cache reuse and served-model usage: what a model-in-the-loop run is read for."""
    out = ["## Paired differences against RIR (95% intervals)", ""]
    for world, data in worlds.items():
        for key, d in data.get("comparisons", {}).items():
            ci = f"[{d['lo']:+.4f}, {d['hi']:+.4f}]"
            out.append(f"- {world}: {key} = {d['mean']:+.4f} {ci} over {d['n']} pairs")
    out += ["", "## Auxiliary replies that failed to parse (fallbacks fired), per role", ""]
    out += [
        "A reply counts once per role when any of its fields fell back; 'no verdict': reviews whose "
        "verdict could not be read (acted on as Continue).",
        "",
        "| world | variant | review | no verdict | coarse | fine | patch | baseline roles "
        "| restores refused |",
        "|" + "---|" * 9,
    ]
    for world, data in worlds.items():
        for name, r in data["results"].items():
            if "parse_failures_by_role" not in r or not r.get("aux_calls"):
                continue
            bad, tot = r["parse_failures_by_role"], r["aux_calls_by_role_total"]
            cells = " | ".join(f"{bad[k]}/{tot[k]}" for k in ("review", "coarse", "fine", "patch"))
            verdicts = f"{r.get('verdict_fallbacks_total', 0)}/{tot['review']}"
            cells = cells.replace(" | ", f" | {verdicts} | ", 1)
            other = ", ".join(
                f"{k} {bad[k]}/{tot[k]}"
                for k in tot
                if k not in ("review", "coarse", "fine", "patch") and tot[k]
            ) or "–"
            out.append(f"| {world} | {name} | {cells} | {other} | {r['restores_refused_total']} |")
    out.append("")
    for world, data in worlds.items():
        if len(data.get("groups") or []) > 1:  # sampler.max_inflight split the batch: wall time per group
            out += [
                f"- {world}: {g['trials']} trials of {', '.join(g['protocols'])} together: "
                f"{g['seconds']:.1f} s ({g['seconds'] / max(1, g['trials']):.2f} s per trial)"
                for g in data["groups"]
            ]
        if data.get("agent_cache"):
            out += [f"- {world}: {metrics.format_cache(data['agent_cache'])}"]
        api = data.get("api")
        if api:
            u = api["usage"]
            out += [
                f"- {world}: served model {api['model']}: {u['requests']} requests, "
                f"{u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens, "
                f"{u['retries']} retries, {u['failed']} failed"
            ]
    out.append("")
    return out


def build_report(worlds: dict[str, dict[str, Any]], tables: list[str], out: Path) -> str:
    lines = [
        "# RIR report",
        "",
        "Every world's variants ran as one paired batch (same tasks, seeds, replicates). "
        "SR: success rate with a Wilson 95% interval; DR: ScienceWorld's normalized final score (the games: "
        "the binary outcome); steps: final path length; actions: environment actions executed, abandoned "
        "ones included; reviews, rollbacks (executed restores) and auxiliary calls per task. "
        f"Rows marked '{PAPER_NOTE}' are the paper's figures, not ours.",
        "",
    ]
    for world, data in worlds.items():
        lines.append(
            f"- {world}: `{data['split']}`, policy `{data['policy']}`, {data['tasks']} tasks × "
            f"{data['seeds']} seeds × {data['trials_per_task']} replicates, {data['seconds']:.0f} s"
            + (
                " — **ALFWorld ran on generated games, not the official ALFWorld games**"
                if data["split"].startswith("alfworld-gen")
                else ""
            )
        )
    lines.append("")
    if "main" in tables:
        names = [n for n in (*RETRAIL, *MAIN) if any(n in d["results"] for d in worlds.values())]
        head = (
            "| method | "
            + " | ".join(f"{w} SR [95% CI]" for w in worlds)
            + " | DR | Avg SR | aux calls / task | rollbacks / task | agent calls / task |"
        )
        lines += ["## Table 1 — main results", "", head, "|" + "---|" * (len(worlds) + 6)]
        for n in names:
            srs = [d["results"].get(n, {}).get("success") for d in worlds.values()]
            cells = []
            for d in worlds.values():
                r = d["results"].get(n)
                cells.append(
                    "–" if r is None else f"{_pct(r['success'])} [{_pct(r['ci95'][0])}, {_pct(r['ci95'][1])}]"
                )
            drs = [d["results"][n].get("dense_reward") for d in worlds.values() if n in d["results"]]
            dr = (
                f"{drs[0]:.3f}"
                if len(drs) == 1 and drs[0] is not None
                else (" / ".join(f"{x:.3f}" for x in drs if x is not None) or "–")
            )
            known = [s for s in srs if s is not None]
            avg = _pct(sum(known) / len(known)) if known else "–"
            cost = []
            for key in ("aux_calls", "rollbacks", "agent_calls"):  # per task, each world's in order
                vals = [d["results"][n].get(key) for d in worlds.values() if n in d["results"]]
                cost.append(" / ".join(f"{x:.2f}" for x in vals if x is not None) or "–")
            row = f"| {LABELS.get(n, n)} | " + " | ".join(cells) + f" | {dr} | {avg} | "
            lines.append(row + " | ".join(cost) + " |")
        p = PAPER["RIR"]
        lines += [
            f"| RIR — {PAPER_NOTE} | "
            + " | ".join("–" for _ in worlds)
            + f" | {p['dense_reward']:.3f} | {_pct(p['success'])} (ScienceWorld) | – | "
            f"{p['rollbacks']:.2f} | – |",
            "",
        ]
        lines += [
            "## Table 2 — executed rollbacks per task",
            "",
            "| method | " + " | ".join(worlds) + " |",
            "|" + "---|" * (len(worlds) + 1),
        ]
        for n in ("RIR/ga-rollback", "RIR/lats", "RIR/restart", "RIR/direct", "RIR/rollback-only", "RIR",
                  "T@1", "T@3"):
            vals = [
                d["results"].get(n, {}).get("rollbacks", d["results"].get(n, {}).get("rewinds"))
                for d in worlds.values()
            ]
            if any(v is not None for v in vals):
                lines.append(
                    f"| {LABELS.get(n, n)} | "
                    + " | ".join("–" if v is None else f"{v:.2f}" for v in vals)
                    + " |"
                )
        lines += [
            f"| RIR — {PAPER_NOTE} | {PAPER['RIR']['rollbacks']:.2f} (ScienceWorld) |",
            f"| GA-Rollback — {PAPER_NOTE} | ≈ 2.9 (ScienceWorld) |",
            "",
            "LATS's rollbacks are the search's moves between tree nodes (the world restored to each selected "
            "node); Reflexion's new trials are resets, not rollbacks (`resets` in summary.json); Self-Refine "
            "restores nothing.",
            "",
        ]
        oracle = {w: d for w, d in worlds.items() if str(d.get("policy", "")).startswith("oracle")}
        if oracle:  # the acceptance bounds are the scripted oracle's; model runs: the paired section
            lines += ["## Oracle acceptance (paired differences, 95% intervals)", ""]
        for world, data in oracle.items():
            for key, d in data.get("acceptance", {}).items():
                lines.append(
                    f"- {world}: {key} = {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] over "
                    f"{d['n']} pairs — lower bound {'above' if d['pass'] else 'NOT above'} 0"
                )
        if oracle:
            lines.append("")
    lines += _model_facts(worlds)
    if "when" in tables:
        lines += _variant_table("Table 3a — when to review", worlds, WHEN)
    if "where" in tables:
        lines += _variant_table("Table 3b — where to recover (Figure 4)", worlds, WHERE)
    if "components" in tables:
        lines += _variant_table("Table 3c — rollback vs reflection", worlds, COMPONENTS)
    if "range" in tables:
        lines += ["## Range sweep (L_min, L_max)", ""]
        for world, data in worlds.items():
            png = out / f"range_{world}.png"
            grid = range_grid(data["results"])
            heat_map(grid, png, f"RIR range sweep — {world}")
            lines += [
                f"### {world}",
                "",
                f"![range heat map]({png.name})",
                "",
                "| L_min \\ L_max | " + " | ".join(str(h) for h in grid["l_max"]) + " |",
                "|" + "---|" * (len(grid["l_max"]) + 1),
            ]
            for i, lo in enumerate(grid["l_min"]):
                cells = []
                for j in range(len(grid["l_max"])):
                    sr, rb = grid["sr"][i][j], grid["rb"][i][j]
                    cells.append("–" if sr is None else f"{_pct(sr)} ({rb:.2f} rb)")
                lines.append(f"| {lo} | " + " | ".join(cells) + " |")
            p = PAPER["RIR/range-2-8"]
            lines += [
                "",
                f"{PAPER_NOTE}: best (2, 8) {_pct(p['success'])} SR with {p['rollbacks']:.2f} rollbacks; "
                f"default (4, 8) {_pct(PAPER['RIR']['success'])}.",
                "",
            ]
    return "\n".join(x for x in lines if x is not None)


def range_grid(results: dict[str, Any]) -> dict[str, Any]:
    cells = {}
    for name, r in results.items():
        if name.startswith("RIR/range-"):
            lo, hi = (int(x) for x in name.rsplit("-", 2)[-2:])
            cells[(lo, hi)] = r
    los = sorted({k[0] for k in cells})
    his = sorted({k[1] for k in cells})
    sr = [[cells[(a, b)]["success"] if (a, b) in cells else None for b in his] for a in los]
    rb = [[cells[(a, b)]["rollbacks"] if (a, b) in cells else None for b in his] for a in los]
    return {"l_min": los, "l_max": his, "sr": sr, "rb": rb}


def heat_map(grid: dict[str, Any], path: Path, title: str) -> None:
    """SR as colour over (L_min, L_max), each cell labelled with SR and rollbacks per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sr = np.array([[np.nan if v is None else v for v in row] for row in grid["sr"]], float)
    fig, ax = plt.subplots(
        figsize=(max(5.0, 1.4 + 1.2 * len(grid["l_max"])), 1.6 + 1.0 * max(1, len(grid["l_min"])))
    )
    im = ax.imshow(
        sr,
        cmap="viridis",
        vmin=np.nanmin(sr) if np.isfinite(sr).any() else 0,
        origin="lower",
        vmax=np.nanmax(sr) if np.isfinite(sr).any() else 1,
    )
    for i in range(sr.shape[0]):
        for j in range(sr.shape[1]):
            if np.isfinite(sr[i, j]):
                ax.text(
                    j,
                    i,
                    f"{100 * sr[i, j]:.1f}%\n{grid['rb'][i][j]:.2f} rb",
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=8,
                )
    if 2 in grid["l_min"] and 8 in grid["l_max"]:  # the paper's best cell, outlined and labelled as theirs
        i, j = grid["l_min"].index(2), grid["l_max"].index(8)
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xticks(range(len(grid["l_max"])), [str(x) for x in grid["l_max"]])
    ax.set_yticks(range(len(grid["l_min"])), [str(x) for x in grid["l_min"]])
    ax.set_xlabel("L_max")
    ax.set_ylabel("L_min")
    p = PAPER["RIR/range-2-8"]
    ax.set_title(
        f"{title}\nred box: the paper's best (2, 8): {100 * p['success']:.2f}% SR,\n"
        f"{p['rollbacks']:.2f} rb (their ScienceWorld, DeepSeek-V3 run)",
        fontsize=8,
    )
    fig.colorbar(im, ax=ax, label="success rate")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_world(
    cfg_path: str,
    overrides: list[str],
    policy_spec: str,
    tables: list[str],
    seeds: int,
    tasks: int | None,
    split: str | None,
    trials_per_task: int | None,
    transcripts: Any = None,
    only: list[str] | None = None,
    device_memory: str | None = None,
) -> dict[str, Any]:
    """One world's runs for ``tables``; ``only``: run just these of the tables' protocols; ``device_memory``:
    plan the policy's sampler rows for a device of that size (default: the device's own)."""
    cfg = config_lib.load(cfg_path, overrides)
    base = cfg.env.split
    split = split or (base if ":" in base else f"{base}:test")
    protocols = protocols_for(tables, cfg)
    if "main" in tables:
        protocols = [*RETRAIL, *protocols]
    if only:
        missing = [p for p in only if p not in protocols]
        if missing:
            raise ValueError(f"--protocol {missing[0]!r} is not among the tables' protocols: "
                             f"{', '.join(protocols)}")
        protocols = [p for p in protocols if p in only]
    cfg = plan_policy_rows(cfg, policy_spec, device_memory)
    policy = make_policy(policy_spec, cfg)
    n = tasks if tasks is not None else cfg.eval.num_tasks
    report = evaluate(cfg, policy, split, protocols, seeds, n, trials_per_task, transcripts=transcripts)
    return {
        "world": cfg.env.name,
        "split": split,
        "policy": policy_spec,
        "tasks": report["tasks"],
        "seeds": seeds,
        "trials_per_task": report["trials_per_task"],
        "seconds": report["seconds"],
        "results": report["results"],
        "acceptance": report.get("rir", {}).get("acceptance", {}),
        "comparisons": report.get("rir", {}).get("comparisons", {}),
        "agent_cache": report.get("rir", {}).get("agent_cache"),
        "groups": report.get("rir", {}).get("groups", []),
        "api": report.get("api"),
        "world_errors": report.get("rir", {}).get("world_errors", {}),
    }


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax rir`` (flags in ``retrojax/cli.py``)."""
    tables = list(TABLES) if args.table == "all" else [t.strip() for t in args.table.split(",")]
    bad = [t for t in tables if t not in TABLES]
    if bad:
        print(f"retrojax rir: unknown table {bad[0]!r}; use {'|'.join(TABLES)}|all", file=sys.stderr)
        return 2
    out = Path(args.out)
    worlds: dict[str, dict[str, Any]] = {}
    try:
        with open_transcripts(getattr(args, "transcripts", None)) as transcripts:
            for cfg_path in [c for item in args.config for c in item.split(",") if c]:
                data = run_world(
                    cfg_path,
                    args.overrides,
                    args.policy,
                    tables,
                    args.seeds,
                    args.tasks,
                    args.split,
                    args.trials_per_task,
                    transcripts,
                    [p.strip() for p in (getattr(args, "protocol", None) or "").split(",") if p.strip()],
                    device_memory=getattr(args, "device_memory", None),
                )
                worlds[data["world"]] = data
    except (ValueError, KeyError, FileNotFoundError, config_lib.ConfigError) as e:
        print(f"retrojax rir: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    text = build_report(worlds, tables, out)
    (out / "report.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(worlds, indent=2, sort_keys=True))
    print(text)
    print(f"wrote {out / 'report.md'}")
    return 0
