"""Role demonstrations: RIR's every role — the agent, the reviewer, the coarse and fine selectors and the
patcher — played by the visible oracle (:class:`~retrojax.agent.rir.policies.RIRVisibleOracle`) through the
real RIR controller and runner, recorded as model calls for the SFT warm start.

Each call's ``prompt_ids`` are the tokens of the exact messages the controller sends that role (agent: its
system prompt with the memory block, the kept turns and the new user turn; auxiliary roles: their single-turn
system and user prompts within ``rir.prompt_budget``), and ``output_ids`` the oracle's reply. Every auxiliary
label is a function of its prompt (the visible oracle reads only what the prompt shows, never the solver's
distance or ``branch_value``); the agent's moves are the solver's, as in ReTRAIL's demonstrations, and its
deliberate random moves are context only (``teach`` False). The warm start
(:func:`retrojax.learn.warm_start.warm_start`) trains on such an archive as on ReTRAIL's: merge it into the
demonstrations with :meth:`Archive.extend`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from retrojax.agent.archive import Archive
from retrojax.agent.rir.controller import AUX_ROLES
from retrojax.agent.rir.policies import RIRVisibleOracle
from retrojax.agent.rir.replies import parse_review
from retrojax.agent.rir.runner import RIRRunner
from retrojax.agent.trial import TrialSpec

ROLES = ("execution", "review", "coarse", "fine", "patch")


def run_role_demonstrations(
    cfg: Any,
    env: Any,
    tokenizer: Any,
    *,
    episodes: int | Mapping[str, int],
    epsilon: float,
    levels: Sequence[int] | None = None,
    protocols: Sequence[str] = ("RIR",),
    first_trial: int = 0,
    batch: int = 64,
) -> tuple[Archive, dict[str, Any]]:
    """``episodes`` RIR trials of the visible oracle (random moves w.p. ``epsilon``) per protocol — one
    count for every protocol, or a count per protocol (``{"RIR": 480, "RIR/react": 80}``: only RIR itself
    makes coarse and fine calls, so a corpus that must teach them weighs RIR up) — on ``levels`` (default:
    every level of ``env``), in groups of ``batch`` trials. ``tokenizer`` None records byte-level ids.
    Returns the archive (trial ids from ``first_trial``) and per-role figures."""
    levels = list(range(env.num_tasks)) if levels is None else list(levels)
    counts = dict(episodes) if isinstance(episodes, Mapping) else {p: episodes for p in protocols}
    missing = [p for p in protocols if p not in counts]
    if missing:
        raise ValueError(f"no episode count for protocol(s) {missing}")
    if any(counts[p] < 1 for p in protocols) or not protocols or not levels:
        raise ValueError(f"need at least one episode per protocol and one level, got {counts} and "
                         f"{len(levels)} levels")
    # interleaved by episode index (protocol order within), so every prefix of the list mixes the protocols
    order = [(i, p) for i in range(max(counts[p] for p in protocols)) for p in protocols if i < counts[p]]
    specs = [
        TrialSpec(
            trial=first_trial + n,
            task=int(levels[i % len(levels)]),
            seed=int(cfg.run.seed),
            replicate=i,  # the oracle's random stream differs between repeats of a level
            protocol=p,
        )
        for n, (i, p) in enumerate(order)
    ]
    runner = RIRRunner(cfg, env, RIRVisibleOracle(epsilon, stall=int(cfg.rir.oracle_stall)),
                       tokenizer=tokenizer, record_tokens=True)
    archive, records = Archive(), []
    for i in range(0, len(specs), max(1, batch)):
        part = runner.run(specs[i : i + batch])
        archive.extend(part.archive)
        records += part.records
    return archive, role_stats(archive, records)


def role_stats(archive: Archive, records: Sequence[Any] = ()) -> dict[str, Any]:
    """Calls per role (and how many are targets), review verdicts, rollbacks and success of the oracle."""
    calls = Counter(c.role for c in archive.calls)
    taught = Counter(c.role for c in archive.calls if c.teach)
    verdicts = Counter(parse_review(c.output_text).verdict for c in archive.calls if c.role == "review")
    out: dict[str, Any] = {
        "calls": {r: calls.get(r, 0) for r in (*ROLES, *AUX_ROLES[4:]) if calls.get(r, 0)},
        "targets": {r: taught.get(r, 0) for r in (*ROLES, *AUX_ROLES[4:]) if calls.get(r, 0)},
        "review_verdicts": dict(verdicts),
    }
    if records:
        out["trials"] = len(records)
        out["success"] = float(np.mean([r.success for r in records]))
        out["rollbacks_per_trial"] = float(np.mean([r.rollbacks for r in records]))
    return out


def role_corpus(archive: Archive, decode: Callable[[Any], str]) -> list[str]:
    """Texts for training a tokenizer on: every auxiliary call's prompt and reply and each trial's longest
    agent context (its earlier agent calls are prefixes of it)."""
    longest: dict[int, Any] = {}
    texts: list[str] = []
    for c in archive.calls:
        if c.role != "execution":
            texts.append(decode(np.concatenate([c.prompt_ids, c.output_ids])))
            continue
        n = len(c.prompt_ids) + len(c.output_ids)
        best = longest.get(c.trial)
        if best is None or n > len(best.prompt_ids) + len(best.output_ids):
            longest[c.trial] = c
    return texts + [decode(np.concatenate([c.prompt_ids, c.output_ids])) for c in longest.values()]
