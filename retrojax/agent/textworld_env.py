"""``TrialEnv`` adapter for the host-side text worlds (ScienceWorld, ALFWorld).

Each slot is one trial of ``envs.textworlds.TextWorldBridge``: ``step`` is one batch of host calls run in
parallel across the worker pool, ``rewind`` is a batch of reset-and-replay calls whose observation is
checked against the one recorded at ``C_j``. A per-trial bridge error (replay divergence, a worker that
died twice) is never silent: the slot's next steps answer ``valid=False`` with the error as the reason,
the trial cannot advance, and :meth:`TextWorldEnv.errors` lists it.

Splits (``NAME:PART``, PART ∈ train | dev | test):

- ``scienceworld:PART`` — every ScienceWorld task; ``scienceworld-boil,melt:PART`` — only those tasks;
  variations follow ScienceWorld's own train/dev/test split.
- ``scienceworld-L0:train`` / ``scienceworld-L0:test`` — the L0 partition (ReTRAIL's Table 5, RLVMR's
  naming): 29 task types (all but use-thermometer), train = their ScienceWorld train variations, test =
  their dev variations; ``scienceworld-L1`` tests on their ScienceWorld test variations, ``scienceworld-L2``
  on 10 task types it never trains on. Types are interleaved so a first-N prefix spans many types
  (``envs.textworlds.scienceworld.level_tasks``, which documents how the rules were derived).
- ``alfworld-gen:PART`` / ``alfworld-gen-heat,cool:PART`` — generated ALFWorld games (``env.num_tasks``
  of them, default 60) cycling over the six task types (or the listed ones).
- ``alfworld-data:PART`` — real ALFWorld games under ``env.data_dir``: train → ``train``, test →
  ``valid_seen`` (the paper's test partition, Table 5), dev → ``valid_unseen``.

Also here: :class:`TextOraclePolicy`, the scripted gold-path / planner player (``OraclePolicy`` with the
world's action format), and :func:`format_action`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from envs.textworlds import Observation, TextWorldBridge
from retrojax.agent import parse
from retrojax.agent.env_api import MOVE, Action, StepInfo, TrialEnv, invalid
from retrojax.agent.parse import format_action
from retrojax.agent.policies import OraclePolicy
from retrojax.agent.prompts import alfworld as _alfworld_prompts  # noqa: F401  (registers templates)
from retrojax.agent.prompts import scienceworld as _scienceworld_prompts  # noqa: F401

MAX_COMMAND_CHARS = 200
DEFAULT_GENERATED_TASKS = 60


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class TextWorldEnv(TrialEnv):
    """Slots over a text-world bridge (see the module docstring)."""

    def __init__(self, world: str, tasks: Sequence[str], *, split: str = "", num_workers: int = 2,
                 timeout_s: float = 30.0, world_kwargs: dict[str, Any] | None = None,
                 bridge: TextWorldBridge | None = None):
        if not tasks:
            raise ValueError(f"split {split!r} of {world} has no tasks")
        self.name = world
        self.prompt_key = world
        self.action_style = "fence" if world == "alfworld" else "tag"
        # D.3: ALFWorld rebuilds the resumed conversation; ScienceWorld puts memory in the next observation
        self.recovery_context = "rebuild" if world == "alfworld" else "observation"
        self.reflection_chooses_target = True  # D.2: every reflection names the checkpoint to restore
        self.split = split
        self.tasks = list(tasks)
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.world_kwargs = dict(world_kwargs or {})
        self.bridge = bridge
        self._own_bridge = bridge is None
        self._slot_trial: dict[int, int] = {}
        self._obs: dict[int, Observation] = {}
        self._errors: dict[int, str] = {}
        self._goals: dict[int, str] = {}
        self.num_slots = 0
        self.prefetch_expert = False  # set by scripted experts: workers precompute the next expert action

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def _bridge(self) -> TextWorldBridge:
        if self.bridge is None:
            self.bridge = TextWorldBridge(self.name, self.num_workers, self.timeout_s, self.world_kwargs)
        self.bridge.prefetch_expert = self.prefetch_expert
        return self.bridge

    def open(self, num_slots: int, capacity: int) -> None:
        if num_slots < 1 or capacity < 2:
            raise ValueError(f"need num_slots ≥ 1 and capacity ≥ 2, got {num_slots}, {capacity}")
        self._bridge()
        self.num_slots = num_slots

    def close(self) -> None:
        if self.bridge is not None and self._own_bridge:
            self.bridge.close()
            self.bridge = None
        self._slot_trial, self._obs = {}, {}

    def errors(self) -> dict[int, str]:
        """Per-slot bridge errors (replay divergence, dead workers) since the slot's last reset."""
        return dict(self._errors)

    def _check(self, slots: Sequence[int]) -> None:
        if self.bridge is None or self.num_slots == 0:
            raise RuntimeError(f"{self.name}: open() the env before using it")
        if len(set(slots)) != len(slots):
            raise ValueError("a slot may appear only once per call")
        for s in slots:
            if not 0 <= s < self.num_slots:
                raise IndexError(f"slots must lie in [0, {self.num_slots})")

    # -- operations --------------------------------------------------------------------------------------
    def _info(self, slot: int, obs: Observation, moves: int) -> StepInfo:
        return StepInfo(reward=float(obs.reward), solved=obs.won, failed=obs.done and not obs.won,
                        progress=float(obs.score), state_key=obs.key, message=_one_line(obs.text),
                        valid=True, moves=moves, score=float(obs.score))

    def _error_info(self, slot: int, error: str) -> StepInfo:
        self._errors[slot] = error
        return StepInfo(valid=False, message=f"the text world failed for this trial: {_one_line(error, 300)}")

    def reset(self, slots: Sequence[int], tasks: Sequence[int]) -> list[StepInfo]:
        self._check(slots)
        for t in tasks:
            if not 0 <= int(t) < self.num_tasks:
                raise IndexError(f"task ids must lie in [0, {self.num_tasks}) for split {self.split}")
        br = self._bridge()
        br.release([self._slot_trial.pop(s) for s in slots if s in self._slot_trial])
        outs = br.reset([self.tasks[int(t)] for t in tasks], admissible=True)
        infos = []
        for s, out in zip(slots, outs, strict=True):
            self._slot_trial[s] = out.trial
            self._errors.pop(s, None)
            if out.ok:
                self._obs[s] = out.obs
                infos.append(self._info(s, out.obs, 0))
            else:
                self._obs[s] = Observation(text=f"[error] {out.error}", score=0.0, progress=0.0,
                                           done=True, won=False)
                self._errors[s] = out.error or "reset failed"
                infos.append(StepInfo(failed=True, message=_one_line(out.error or "reset failed")))
        return infos

    def step(self, slots: Sequence[int], actions: Sequence[Action]) -> list[StepInfo]:
        self._check(slots)
        for s, a in zip(slots, actions, strict=True):
            if not a.is_move:
                raise ValueError(f"step takes moves only, got a {a.kind} action for slot {s}")
        live = [(s, a) for s, a in zip(slots, actions, strict=True) if s not in self._errors]
        outs = self._bridge().step([self._slot_trial[s] for s, _ in live], [a.text for _, a in live],
                                   admissible=True) if live else []
        by_slot = {s: o for (s, _), o in zip(live, outs, strict=True)}
        infos = []
        for s, a in zip(slots, actions, strict=True):
            if s in self._errors:
                infos.append(self._error_info(s, self._errors[s]))
                continue
            out = by_slot[s]
            if not out.ok:
                infos.append(self._error_info(s, out.error or "step failed"))
                continue
            obs = out.obs
            if not obs.valid:  # the engine's state did not move: keep the current observation
                why = f"the world did not accept '{_one_line(a.text, 60)}': {_one_line(obs.text)}"
                infos.append(StepInfo(valid=False, message=why))
                continue
            self._obs[s] = obs
            infos.append(self._info(s, obs, 1))
        return infos

    def rewind(self, slots: Sequence[int], targets: Sequence[int]) -> None:
        self._check(slots)
        live = [(s, j) for s, j in zip(slots, targets, strict=True) if s not in self._errors]
        if not live:
            return
        outs = self._bridge().rewind([self._slot_trial[s] for s, _ in live], [int(j) for _, j in live],
                                     admissible=True)
        for (s, j), out in zip(live, outs, strict=True):
            if out.ok:
                self._obs[s] = out.obs
            else:
                if out.error and out.error.startswith("rewind target"):
                    raise IndexError(f"slot {s}: {out.error}")
                self._errors[s] = out.error or f"rewind to C_{j} failed"

    def observations(self, slots: Sequence[int]) -> list[str]:
        self._check(slots)
        return [self.render(self._obs[s]) for s in slots]

    def render(self, obs: Observation) -> str:
        """The observation block of a user turn: the engine's text plus what the prompt lists."""
        adm = obs.admissible or {}
        if self.name == "scienceworld":
            lines = [obs.text.strip(), "", f"Score so far: {obs.score:g} / 100."]
            if adm.get("templates"):
                lines.append("Action templates (OBJ = an object): " + "; ".join(adm["templates"]) + ".")
            if adm.get("objects"):
                lines.append("Objects you can refer to: " + ", ".join(adm["objects"]) + ".")
            return "\n".join(lines)
        lines = [obs.text.strip()]
        if adm.get("actions"):
            lines += ["", "Admissible commands: " + "; ".join(adm["actions"]) + "."]
        return "\n".join(lines)

    def format_action(self, text: str) -> str:
        """``text`` in the reply format this world's prompts ask for (for scripted players)."""
        return format_action(text, self.action_style)

    def parse_action(self, text: str) -> Action:
        rewind = parse.parse_rewind(text)
        if rewind is not None:
            return rewind
        command = " ".join(str(text).split())
        if not command:
            return invalid("the action is empty; write one command", text)
        if len(command) > MAX_COMMAND_CHARS:
            return invalid(f"the command is too long ({len(command)} characters); write one command",
                           command[:MAX_COMMAND_CHARS])
        if "\n" in str(text).strip():
            return invalid("write exactly one command on one line", command)
        return Action(kind=MOVE, text=command)

    def branch_value(self, progress: Sequence[float], solved: bool, failed: bool) -> float:
        return float(max(progress)) if len(progress) else 0.0

    def expert_actions(self, slots: Sequence[int]) -> list[str | None]:
        self._check(slots)
        live = [s for s in slots if s not in self._errors]
        outs = self._bridge().expert([self._slot_trial[s] for s in live]) if live else []
        got = {s: (o.value if o.ok else None) for s, o in zip(live, outs, strict=True)}
        return [got.get(s) for s in slots]

    def random_actions(self, slots: Sequence[int], rng: np.random.Generator,
                       avoid: Sequence[frozenset[str]] = ()) -> list[str]:
        self._check(slots)
        pools: dict[int, list[str]] = {}
        for s in slots:  # ALFWorld: the admissible commands came with the observation
            adm = self._obs[s].admissible if s in self._obs else None
            if self.name == "alfworld" and adm and adm.get("actions"):
                pools[s] = list(adm["actions"])
        live = [s for s in slots if s not in self._errors and s not in pools]
        outs = self._bridge().candidates([self._slot_trial[s] for s in live]) if live else []
        for s, o in zip(live, outs, strict=True):
            pools[s] = list(o.value) if o.ok and o.value else []
        out = []
        for i, s in enumerate(slots):
            pool = pools.get(s) or ["look around" if self.name == "scienceworld" else "look"]
            skip = avoid[i] if i < len(avoid) else frozenset()
            choices = [a for a in pool if a not in skip] or pool
            out.append(str(choices[int(rng.integers(len(choices)))]))
        return out

    def goal_of(self, task: int) -> str:
        """The task's goal text (asks the engine once per task)."""
        if task not in self._goals:
            br = self._bridge()
            (o,) = br.reset([self.tasks[task]])
            if o.ok:
                (g,) = br.goal([o.trial])
                self._goals[task] = str(g.value) if g.ok else ""
            else:
                self._goals[task] = ""
            br.release([o.trial])
        return self._goals[task]

    def prompt_fields(self, task: int) -> dict[str, Any]:
        return {"goal": self.goal_of(task)}


# --------------------------------------------------------------------------------------------------
# The scripted text player
# --------------------------------------------------------------------------------------------------


class TextOraclePolicy(OraclePolicy):
    """``OraclePolicy`` (gold path / planner with probability 1 − ε, a random candidate otherwise, rewinds
    and remarks); like every scripted policy it writes actions in the world's format (``Policy.act``). It asks
    the workers to precompute the expert's next action with every step, so a turn costs one engine visit.
    """

    def begin(self, specs, slots, env) -> None:
        super().begin(specs, slots, env)
        if hasattr(env, "prefetch_expert"):
            env.prefetch_expert = True


# --------------------------------------------------------------------------------------------------
# Factories (registered in env_api)
# --------------------------------------------------------------------------------------------------


def _split(cfg: Any, split: str | None, family: str) -> tuple[str, str, list[str]]:
    """``NAME[-a,b]:PART`` → (name, part, subset)."""
    name = split or cfg.env.split
    if ":" not in name:
        name = f"{name}:train"
    base, part = name.rsplit(":", 1)
    if part not in ("train", "dev", "test"):
        raise ValueError(f"split {name!r}: the part must be train, dev or test")
    if not base.startswith(family):
        raise ValueError(f"split {name!r} is not a {family} split")
    rest = base[len(family):]
    if rest and not rest.startswith("-"):
        raise ValueError(f"split {name!r} is not a {family} split")
    subset = [x for x in rest[1:].split(",") if x] if rest else []
    return base, part, subset


def _limit(tasks: list[str], cfg: Any) -> list[str]:
    n = cfg.env.num_tasks
    return tasks[:n] if n is not None else tasks


def make_scienceworld(cfg: Any, split: str | None = None) -> TextWorldEnv:
    from envs.textworlds.scienceworld import level_tasks, split_tasks

    base, part, names = _split(cfg, split, "scienceworld")
    if len(names) == 1 and re.fullmatch(r"L\d+", names[0]):  # a partition: L0 | L1 | L2 (others: an error)
        tasks = level_tasks(names[0], part, cache_dir=cfg.env.cache_dir)
    else:
        tasks = split_tasks(names or None, part, cache_dir=cfg.env.cache_dir)
    tasks = _limit(tasks, cfg)
    kwargs = {"step_limit": cfg.env.text_step_limit, "cache_dir": cfg.env.cache_dir}
    return TextWorldEnv("scienceworld", tasks, split=f"{base}:{part}", num_workers=cfg.env.text_workers,
                        timeout_s=cfg.env.step_timeout_s, world_kwargs=kwargs)


# The paper's partitions (Table 5): ALFWorld's test split is valid_seen; valid_unseen serves as dev here.
ALFWORLD_DATA_PARTS = {"train": "train", "dev": "test", "test": "dev"}  # our part -> data_tasks' part


def make_alfworld(cfg: Any, split: str | None = None) -> TextWorldEnv:
    from envs.textworlds.alfworld import data_tasks
    from envs.textworlds.alfworld_gen import generated_tasks

    name = split or cfg.env.split
    if name.startswith("alfworld-data"):
        base, part, _ = _split(cfg, split, "alfworld-data")
        if not cfg.env.data_dir:
            raise ValueError("split alfworld-data needs env.data_dir (a folder of ALFWorld games)")
        tasks = _limit(data_tasks(cfg.env.data_dir, ALFWORLD_DATA_PARTS[part]), cfg)
    else:
        base, part, types = _split(cfg, split, "alfworld-gen")
        tasks = generated_tasks(part, cfg.env.num_tasks or DEFAULT_GENERATED_TASKS, types or None)
    return TextWorldEnv("alfworld", tasks, split=f"{base}:{part}", num_workers=cfg.env.text_workers,
                        timeout_s=cfg.env.step_timeout_s)
