"""Policies: the same text interface for a Qwen3 model and for scripted players.

A policy answers a batch of :class:`~retrojax.agent.trial.Request` objects (one per live trial) with one
:class:`~retrojax.agent.trial.Generation` each, in one call per tick. Its replies go through the same
parser and budgets as a model's.

- :class:`ModelPolicy`: one sampler row per trial slot (slots are reused: the runner keeps at most
  ``sampler.max_inflight`` trials live and starts queued ones in freed slots, see ``assign``). Each tick
  it brings every requested row in line with the request's exact context ids (a rewound conversation
  becomes ``sampler.rewind`` to the common prefix, then one batched ``append`` of the new turns) and makes
  one batched ``generate`` per kind of call (execution / reflection). Output ids and log-probs are the
  sampler's. A reflection's context c_ref is its own conversation, so the row is re-synced to the
  execution context on the next execution call. A context that leaves no room in the row answers
  ``finish_reason="context"`` (the trial then ends).
- :class:`RandomPolicy`: well-formed random actions and occasional rewinds.
- :class:`NotesPolicy`: Sokoban's push notes followed to the letter (the baseline for a model reading them).
- :class:`OraclePolicy`: the world's expert action (solver / deduction) with probability ``1 − ε`` and a
  random action otherwise. It notices when its own random action did not advance the branch (the world's
  branch value ≤ 0) and asks to rewind one step when the loop allows it; its remarks name the mistake as
  ``avoid '<action>' at state <key>``, and it reads the remarks in its context to avoid remembered
  mistakes after a restore (so its memory lives exactly where a model's would).

Scripted policies return text only; the trial tokenizes it (the runner's tokenizer, byte-level by
default) with zero log-probs. Randomness is per trial, seeded from (seed, task, replicate), so trials of
different protocols share their random draws until their paths differ.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from retrojax.agent import parse
from retrojax.agent.chat import ChatTokenizer, wrap_tokenizer
from retrojax.agent.env_api import TrialEnv
from retrojax.agent.trial import EXECUTE, REFLECT_CHOOSE, Generation, Request, TrialSpec, TrialView

_AVOID = re.compile(r"avoid '([^']*)' at state ([0-9a-f]+)")


class Policy(abc.ABC):
    """Answers batches of requests. ``tokenizer`` is set by model policies (the runner then uses it)."""

    tokenizer: ChatTokenizer | None = None
    needs_text: bool = False  # True when the policy reads the prompt (the runner renders prompts then)

    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: TrialEnv) -> None:
        """A new batch of trials starts in ``slots`` of ``env``."""
        self.env = env

    @abc.abstractmethod
    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        """One reply per request, in order."""

    def act(self, action: str) -> str:
        """``action`` in the reply format of the current world (tag or fenced block)."""
        return parse.format_action(action, getattr(self.env, "action_style", "tag"))

    def assign(self, spec: TrialSpec, slot: int) -> None:  # noqa: B027  (optional hook)
        """A queued trial starts in ``slot`` (freed by :meth:`release`) while the batch runs."""

    def release(self, spec: TrialSpec, slot: int) -> None:  # noqa: B027  (optional hook)
        """The trial ``spec`` in ``slot`` has ended; its per-trial state may go."""

    def end(self) -> None:  # noqa: B027  (optional hook; stateless policies keep nothing)
        """The batch is over (release per-trial state)."""


def _trial_rng(spec: TrialSpec, salt: int) -> np.random.Generator:
    return np.random.default_rng([spec.seed, spec.task, spec.replicate, salt])


# --------------------------------------------------------------------------------------------------
# Scripted policies
# --------------------------------------------------------------------------------------------------


class RandomPolicy(Policy):
    """Random well-formed actions; with probability ``rewind_prob`` a rewind to a random earlier C_j."""

    def __init__(self, rewind_prob: float = 0.1):
        if not 0.0 <= rewind_prob <= 1.0:
            raise ValueError(f"rewind_prob must lie in [0, 1], got {rewind_prob}")
        self.rewind_prob = rewind_prob
        self.rngs: dict[int, np.random.Generator] = {}

    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: TrialEnv) -> None:
        super().begin(specs, slots, env)
        self.rngs = {s.trial: _trial_rng(s, 1) for s in specs}

    def assign(self, spec: TrialSpec, slot: int) -> None:
        self.rngs[spec.trial] = _trial_rng(spec, 1)

    def release(self, spec: TrialSpec, slot: int) -> None:
        self.rngs.pop(spec.trial, None)

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        out = []
        for req in requests:
            rng, v = self.rngs[req.trial], req.view
            if v.kind == EXECUTE:
                if v.checkpoint > 0 and rng.random() < self.rewind_prob:
                    j = int(rng.integers(v.checkpoint))
                    out.append(Generation(f"Going back.\n{self.act(f'rewind to C_{j}')}"))
                else:
                    move = self.env.random_actions([v.slot], rng)[0]
                    out.append(Generation(f"A random move.\n{self.act(move)}"))
            else:
                text = f"<remark>Random play from C_{v.target} to C_{v.checkpoint} did not finish.</remark>"
                if v.kind == REFLECT_CHOOSE:
                    j = int(v.targets[int(rng.integers(len(v.targets)))])
                    text += f"\n{self.act(f'rewind to C_{j}')}"
                out.append(Generation(text))
        return out

    def end(self) -> None:
        self.rngs = {}


class OraclePolicy(Policy):
    """The expert's action with probability ``1 − epsilon``, a random one otherwise; see the module doc."""

    def __init__(self, epsilon: float = 0.3):
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must lie in [0, 1], got {epsilon}")
        self.epsilon = epsilon
        self.rngs: dict[int, np.random.Generator] = {}
        self.last_random: dict[int, tuple[int, str, str]] = {}  # trial -> (k, state key, action)

    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: TrialEnv) -> None:
        super().begin(specs, slots, env)
        self.rngs = {s.trial: _trial_rng(s, 2) for s in specs}
        self.last_random = {}

    def assign(self, spec: TrialSpec, slot: int) -> None:
        self.rngs[spec.trial] = _trial_rng(spec, 2)

    def release(self, spec: TrialSpec, slot: int) -> None:
        self.rngs.pop(spec.trial, None)
        self.last_random.pop(spec.trial, None)

    def end(self) -> None:
        self.rngs, self.last_random = {}, {}

    @staticmethod
    def remembered_pairs(text: str) -> list[tuple[str, str]]:
        """``(action, state key)`` pairs named as ``avoid '<action>' at state <key>`` in a remark."""
        return [(a, k) for a, k in _AVOID.findall(text)]

    @classmethod
    def remembered(cls, view: TrialView) -> dict[str, set[str]]:
        """Mistakes named in the remarks in context: state key → actions to avoid there."""
        out: dict[str, set[str]] = {}
        for _, text in view.remarks:
            for action, key in cls.remembered_pairs(text):
                out.setdefault(key, set()).add(action)
        return out

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        execs = [r for r in requests if r.view.kind == EXECUTE]
        expert = dict(zip((r.trial for r in execs),
                          self.env.expert_actions([r.slot for r in execs]) if execs else [], strict=True))
        out = []
        for req in requests:
            if req.view.kind == EXECUTE:
                out.append(self._execute(req, expert[req.trial]))
            else:
                out.append(self._reflect(req))
        return out

    def _execute(self, req: Request, expert: str | None) -> Generation:
        v, rng = req.view, self.rngs[req.trial]
        k = v.checkpoint
        last = self.last_random.pop(req.trial, None)
        undo = last is not None and last[0] + 1 == k and v.path and v.path[-1] == last[2]
        if undo and (k - 1) in v.targets:
            value = self.env.branch_value(v.progress[-2:], False, False)
            if value <= 0:
                self.last_random[req.trial] = last  # the reflection names it
                return Generation(f"My random move '{last[2]}' did not help.\n"
                                  f"{self.act(f'rewind to C_{k - 1}')}")
        avoid = frozenset(self.remembered(v).get(v.state_key, set()))
        if expert is None or expert in avoid or rng.random() < self.epsilon:
            action = self.env.random_actions([v.slot], rng, [avoid])[0]
            self.last_random[req.trial] = (k, v.state_key, action)
            return Generation(f"Trying something.\n{self.act(action)}", teach=False)
        return Generation(f"Following the plan.\n{self.act(expert)}")

    def _reflect(self, req: Request) -> Generation:
        v = req.view
        k = v.checkpoint
        if v.kind == REFLECT_CHOOSE:
            # the best point reached before the trigger (ties: the latest)
            values = [self.env.branch_value(v.progress[: i + 1], False, False) for i in v.targets]
            best = max(values)
            j = max(i for i, val in zip(v.targets, values, strict=True) if val == best)
        else:
            j = v.target
        lines = [f"From C_{j} I went on to C_{k} ({v.trigger}); "
                 f"the actions were: {', '.join(v.path[j:]) or 'none'}."]
        last = self.last_random.pop(req.trial, None)
        keys = self.remembered(v)
        if v.kind == REFLECT_CHOOSE and j < k and j < len(v.path):
            # the action taken at C_j led into this branch; at the failure it is the one to avoid
            if j == k - 1:
                keys.setdefault(self._key_at(v, j), set()).add(v.path[j])
        if last is not None and last[0] >= j:
            keys.setdefault(last[1], set()).add(last[2])
        named = [f"avoid '{a}' at state {key}" for key, acts in sorted(keys.items()) for a in sorted(acts)]
        lines.append("Mistakes: " + ("; ".join(named) if named else "none identified") + ".")
        lines.append(f"Plan from C_{j}: follow the expert line and avoid those actions.")
        text = "<remark>" + "\n".join(lines) + "</remark>"
        if v.kind == REFLECT_CHOOSE:
            text += f"\n{self.act(f'rewind to C_{j}')}"
        return Generation(text)

    @staticmethod
    def _key_at(view: TrialView, j: int) -> str:
        return view.keys[j]


class NotesPolicy(Policy):
    """Sokoban with ``env.push_notes``: the move the notes in its prompt name (``follow_push_notes``), never a
    rewind of its own; a forced recovery goes back to the latest checkpoint it may choose.

    The baseline for any policy that reads the same notes: what the notes alone are worth on those rooms.
    """

    needs_text = True

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        from envs.sokoban.text import follow_push_notes

        out = []
        for req in requests:
            v = req.view
            if v.kind == EXECUTE:
                users = [m["content"] for m in req.messages if m.get("role") == "user"]
                move = follow_push_notes(req.prompt_text or (users[-1] if users else ""))
                if move is None:
                    raise ValueError("--policy notes reads push notes: set env.push_notes=true (Sokoban)")
                out.append(Generation(f"Following the notes.\n{self.act(move)}"))
            else:
                text = f"<remark>The notes' line from C_{v.target} did not finish.</remark>"
                if v.kind == REFLECT_CHOOSE:
                    text += f"\n{self.act(f'rewind to C_{max(v.targets)}')}"
                out.append(Generation(text))
        return out


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class ModelPolicy(Policy):
    """Qwen3 + the batched KV-cache sampler; one sampler row per trial slot."""

    needs_text = True

    def __init__(self, model: Any, tokenizer: Any, *, max_len: int = 4096, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 chunk_buckets: Sequence[int] = (32, 128, 512, 2048),
                 stop_strings: Sequence[str] = ("</action>",),
                 reflection_stop_strings: Sequence[str] = ("</action>",), row_buckets: bool = False,
                 longest_reply: int = 16, kv: str = "dense", kv_pages: int | None = None):
        self.model = model
        # the longest reply any call asks for (tokens): the sampler's decode buffers are at least this long,
        # so execution and reflection calls share decode programs (each request keeps its own limit)
        self.longest_reply = int(longest_reply)
        self.row_buckets = row_buckets
        self.kv = kv  # the sampler's key/value layout (sampler.kv: paged | dense)
        self.kv_pages = kv_pages  # paged: the page pool's size (None: every row at max_len)
        self.raw_tokenizer = tokenizer
        self.tokenizer = wrap_tokenizer(tokenizer)
        self.max_len, self.temperature, self.top_p, self.top_k = max_len, temperature, top_p, top_k
        self.aux_temperature: float | None = None  # calls other than the agent's move (None: temperature)
        self.chunk_buckets = tuple(chunk_buckets)
        self.stop_strings, self.reflection_stop_strings = tuple(stop_strings), tuple(reflection_stop_strings)
        self.seed = seed
        self.sampler = None
        self.ticks = 0

    @classmethod
    def from_config(cls, cfg: Any, model: Any, tokenizer: Any) -> ModelPolicy:
        s = cfg.sampler
        return cls(model, tokenizer, max_len=s.max_len, temperature=s.temperature, top_p=s.top_p,
                   top_k=s.top_k, seed=cfg.run.seed, chunk_buckets=s.chunk_buckets,
                   row_buckets=s.row_buckets, longest_reply=max(s.max_new_tokens, s.max_reflection_tokens),
                   kv=s.kv, kv_pages=None if getattr(s, "kv_pages", "auto") == "auto" else int(s.kv_pages))

    def program_bounds(self, rows: int) -> dict[str, int]:
        """The most programs a sampler of ``rows`` rows built by :meth:`begin` compiles for this policy's
        calls, per jitted function (``retrojax.sampler.program_bounds``): one decode shape per distinct stop-
        string set (execution, reflection), since every call's buffer is ``longest_reply`` long and the stop
        ids are the tokenizer's; row buckets (``sampler.row_buckets``) multiply the per-call programs."""
        from retrojax.model.qwen3 import use_layer_copies
        from retrojax.sampler import program_bounds
        from retrojax.sampling.pages import PAGE_SIZE, pages_for
        from retrojax.serve.batching import default_row_buckets

        paged = self.kv == "paged"
        return program_bounds(max_len=self.max_len, chunk_buckets=self.chunk_buckets,
                              decode_shapes=len({self.stop_strings, self.reflection_stop_strings}),
                              layer_copies=use_layer_copies(getattr(self.model, "layer_copies", "auto")),
                              page_table=rows * pages_for(self.max_len, PAGE_SIZE) if paged else 0,
                              row_buckets=len(default_row_buckets(rows)) if self.row_buckets else 1)

    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: TrialEnv) -> None:
        from retrojax.sampler import Sampler

        super().begin(specs, slots, env)
        rows = max(slots) + 1 if len(slots) else 1
        if self.sampler is None or self.sampler.rows < rows:
            kind = Sampler
            if self.row_buckets:  # each call decodes only its rows (sampler.row_buckets)
                from retrojax.serve.batching import RowBucketSampler as kind
            self.sampler = kind(self.model, rows=rows, max_len=self.max_len, tokenizer=self.raw_tokenizer,
                                chunk_buckets=self.chunk_buckets, min_out_len=self.longest_reply, kv=self.kv,
                                pages=self.kv_pages if self.kv == "paged" else None)
        for s in slots:
            self.sampler.reset(s)

    def assign(self, spec: TrialSpec, slot: int) -> None:
        """A queued trial takes over ``slot``: its cache row starts empty."""
        self.sampler.reset(slot)

    def _sync(self, requests: Sequence[Request]) -> None:
        """Bring each row to its request's context: rewind to the common prefix, append the rest."""
        rows, chunks = [], []
        for req in requests:
            cached = self.sampler.tokens(req.slot)
            want = req.prompt_ids
            n = min(cached.size, want.size)
            diff = np.nonzero(cached[:n] != want[:n])[0]
            common = int(diff[0]) if diff.size else n
            if common < cached.size:
                self.sampler.rewind(req.slot, common)
            if want.size > common:
                rows.append(req.slot)
                chunks.append(want[common:])
        if rows:
            self.sampler.append(rows, chunks)

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        import jax

        fits = [r for r in requests if r.prompt_ids.size + 1 < self.max_len]
        self._sync(fits)
        results: dict[int, Generation] = {}
        for r in requests:
            if r.prompt_ids.size + 1 >= self.max_len:  # no room left in the cache row: the trial ends
                results[r.trial] = Generation("", np.zeros(0, np.int32), np.zeros(0, np.float32), "context")
        stop_ids = list(self.tokenizer.stop_ids)
        key = jax.random.fold_in(jax.random.key(self.seed), self.ticks)
        self.ticks += 1
        for i, (group, stops) in enumerate(((
                [r for r in fits if r.view.kind == EXECUTE], self.stop_strings),
                ([r for r in fits if r.view.kind != EXECUTE], self.reflection_stop_strings))):
            if not group:
                continue
            max_new = max(r.max_new_tokens for r in group)
            temperature = self.temperature if i == 0 or self.aux_temperature is None else self.aux_temperature
            gens = self.sampler.generate([r.slot for r in group], max_new, temperature=temperature,
                                         top_p=self.top_p, top_k=self.top_k, stop_token_ids=stop_ids,
                                         stop_strings=stops, key=jax.random.fold_in(key, i))
            for r, g in zip(group, gens, strict=True):
                results[r.trial] = Generation(g.text or "", g.ids, g.logprobs, g.finish_reason)
        return [results[r.trial] for r in requests]


# --------------------------------------------------------------------------------------------------
# Transcripts
# --------------------------------------------------------------------------------------------------


class TranscriptPolicy:
    """Wraps any policy and writes one JSON line per model call to ``out`` (an open text file): ``protocol``,
    ``task``, ``seed``, ``replicate``, ``trial``, ``call`` (the call's index within its trial), ``role``
    (execution, reflection, review, coarse, fine, patch), ``messages`` (exactly the chat context the request
    carries: what a served model is sent, and the text of a local model's prompt ids), ``reply`` and
    ``finish_reason``. It asks the runner to render prompts (``needs_text``), so scripted runs have
    transcripts too; everything else (tokenizer, assign/release, a served model's report) is the wrapped
    policy's."""

    needs_text = True

    def __init__(self, inner: Any, out: Any):
        self.inner, self.out = inner, out
        self.specs: dict[int, TrialSpec] = {}
        self.counts: dict[tuple[str, int], int] = {}

    @property
    def tokenizer(self) -> ChatTokenizer | None:
        return self.inner.tokenizer

    def __getattr__(self, name: str) -> Any:  # assign, release, report, aux_row, …: the wrapped policy's
        return getattr(self.inner, name)

    def begin(self, specs: Sequence[TrialSpec], slots: Sequence[int], env: TrialEnv) -> None:
        self.specs.update({s.trial: s for s in specs})
        self.inner.begin(specs, slots, env)

    def assign(self, spec: TrialSpec, slot: int) -> None:
        inner = getattr(self.inner, "assign", None)
        if inner is None:
            raise TypeError(f"{type(self.inner).__name__} has no assign(spec, slot)")
        self.specs[spec.trial] = spec
        inner(spec, slot)

    def end(self) -> None:
        self.inner.end()

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        import json

        gens = self.inner.generate(requests)
        if len(gens) == len(requests):  # a mismatch is the runner's error to raise
            for req, gen in zip(requests, gens, strict=True):
                spec = self.specs[req.trial]
                key = (spec.protocol, req.trial)
                call = self.counts.get(key, 0)
                self.counts[key] = call + 1
                line = {
                    "protocol": spec.protocol,
                    "task": spec.task,
                    "seed": spec.seed,
                    "replicate": spec.replicate,
                    "trial": req.trial,
                    "call": call,
                    "role": req.role,
                    "messages": [dict(m) for m in req.messages],
                    "reply": gen.text if isinstance(gen.text, str) else "",
                    "finish_reason": gen.finish_reason,
                }
                self.out.write(json.dumps(line) + "\n")  # ASCII escapes: a lone surrogate stays valid
            self.out.flush()
        return gens
