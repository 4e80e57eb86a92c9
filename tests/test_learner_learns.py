"""The whole stack learns: a tiny Qwen3 on a one-step task where one action is rewarded.

Real sampler (``ModelPolicy``), real trial loop (``Runner``, T@3 with recoveries), real advantages (each
estimator), real batches and the jitted update (``Trainer``). The task: from the start the action ``right``
solves it (reward +1), ``left`` falls into a pit (reward −1, a failure that T@3 recovers from), anything
else is an invalid turn. A 16-token vocabulary (one token per action) keeps the start probability of
``right`` near 1/16, so a rise is the learner's doing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from retrojax.agent.env_api import MOVE, Action, StepInfo, TrialEnv, invalid, text_key
from retrojax.agent.policies import ModelPolicy
from retrojax.agent.prompts import PromptSet, register
from retrojax.agent.runner import Runner
from retrojax.agent.trial import Limits, Trial, TrialSpec
from retrojax.config import from_dict
from retrojax.learn.trainer import Trainer
from retrojax.model import Qwen3, Qwen3Config, token_logprobs

IM_START, IM_END, RIGHT, LEFT = 0, 1, 2, 3
WORDS = {RIGHT: "<action>right</action>", LEFT: "<action>left</action>"}
FILLER = "abcdefghijkl"  # ids 4..15
VOCAB = 16


class WordTokenizer:
    """One token per action (ids 2, 3), chat markers (0, 1) and 12 filler letters; prompt text is mapped
    letter by letter onto the filler ids (lossy, which the model does not mind)."""

    stop_token_ids = (IM_END,)
    stop_ids = [IM_END]
    vocab_size = VOCAB

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str) -> list[int]:
        return [4 + b % len(FILLER) for b in text.encode()]

    def encode_turn(self, role: str, text: str) -> list[int]:
        return [IM_START, *self.encode(f"{role}\n{text}"), IM_END]

    def generation_prompt(self) -> list[int]:
        return [IM_START, *self.encode("a")]

    def close_turn(self, output_ids: Sequence[int]) -> list[int]:
        return [] if len(output_ids) and int(output_ids[-1]) == IM_END else [IM_END]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(WORDS.get(int(i), FILLER[int(i) - 4] if int(i) >= 4 else "") for i in ids)

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        return [self.decode([i]).encode() for i in range(vocab_size)]


register("onestep", "compact", PromptSet(
    system="go {max_calls} {branch_budget} {rewind_rules}", user="{observation}{note}", memory="m {remark}",
    reflect_known="r {target}", reflect_choose="r {targets}", rules="", rewind_allowed="rw",
    rewind_forbidden="no", triggers={"model": "m", "failure": "f", "branch_budget": "b"},
))


class OneStepEnv(TrialEnv):
    """Position 0; ``right`` → 1 (solved, +1), ``left`` → −1 (failed, −1)."""

    name = prompt_key = "onestep"

    @property
    def num_tasks(self) -> int:
        return 4

    def open(self, num_slots: int, capacity: int) -> None:
        self.paths = {s: [0] for s in range(num_slots)}

    def close(self) -> None:
        self.paths = {}

    def _info(self, s: int, reward: float = 0.0) -> StepInfo:
        p = self.paths[s][-1]
        return StepInfo(reward=reward, solved=p > 0, failed=p < 0, progress=float(p),
                        state_key=text_key(str(p)), moves=1)

    def reset(self, slots, tasks) -> list[StepInfo]:
        for s in slots:
            self.paths[s] = [0]
        return [self._info(s) for s in slots]

    def step(self, slots, actions) -> list[StepInfo]:
        out = []
        for s, a in zip(slots, actions, strict=True):
            d = 1 if a.text == "right" else -1
            self.paths[s].append(d)
            out.append(self._info(s, float(d)))
        return out

    def rewind(self, slots, targets) -> None:
        for s, j in zip(slots, targets, strict=True):
            del self.paths[s][j + 1 :]

    def observations(self, slots) -> list[str]:
        return [f"p{self.paths[s][-1]}" for s in slots]

    def parse_action(self, text: str) -> Action:
        if text in ("right", "left"):
            return Action(kind=MOVE, text=text, code=(1,))
        return invalid("right or left", text)

    def branch_value(self, progress, solved, failed) -> float:
        return float(progress[-1]) - float(progress[0])

    def expert_actions(self, slots):
        return ["right" for _ in slots]

    def random_actions(self, slots, rng, avoid=()):
        return ["left" for _ in slots]

    def prompt_fields(self, task: int) -> dict:
        return {}


def config(estimator: str, out_dir) -> object:
    return from_dict({
        "model": {"preset": "tiny", "dtype": "float32"},
        "sampler": {"max_len": 96, "max_new_tokens": 2, "max_reflection_tokens": 2,
                    "chunk_buckets": [32, 64]},
        "trial": {"protocol": "T@3", "max_calls": 4, "branch_budget": 2, "prompt_style": "compact",
                  "trials_per_task": 8, "history_events": 0},
        "learn": {"estimator": estimator, "updates": 6, "tasks_per_update": 4, "learning_rate": 2e-2,
                  "seq_buckets": [64, 96], "max_batch_tokens": 4096, "logprob_chunk": 32, "lambda_ref": 0.5},
        "eval": {"every": -1},
        "run": {"out_dir": str(out_dir), "seed": 0},
    })


class Collect:
    """The trainer's collect: the real runner with a ``ModelPolicy`` on the one-step world."""

    def __init__(self, cfg):
        self.cfg, self.env, self.tok = cfg, OneStepEnv(), WordTokenizer()
        self.policy: ModelPolicy | None = None

    def __call__(self, model, tasks, seeds):
        from retrojax.eval.metrics import summarize
        from retrojax.learn.collect import _flatten

        if self.policy is None:
            self.policy = ModelPolicy(model, self.tok, max_len=96, chunk_buckets=(32, 64), seed=int(seeds[0]))
            self.runner = Runner(self.cfg, self.env, self.policy)
        else:
            self.policy.model = model
            self.policy.sampler.update_model(model)
        self.policy.seed, self.policy.ticks = int(seeds[0]), 0
        b = self.cfg.trial.trials_per_task
        specs = [TrialSpec(trial=i * b + r, task=int(t), seed=int(s), replicate=r, protocol="T@3")
                 for i, (t, s) in enumerate(zip(tasks, seeds, strict=True)) for r in range(b)]
        archive = self.runner.run(specs)
        return archive, _flatten(summarize(archive.trials))


_logprobs = nnx.jit(lambda model, ids, targets: token_logprobs(model, ids, targets, chunk=32))


def p_right(model, cfg) -> float:
    """The model's probability of ``right`` as its first reply token at C_0."""
    env = OneStepEnv()
    env.open(1, 8)
    from retrojax.agent.prompts import get_prompts

    trial = Trial(TrialSpec(0, 0, 0, 0, "T@3"), 0, env, Limits.from_config(cfg),
                  get_prompts("onestep", "compact"), WordTokenizer())
    trial.start(env.reset([0], [0])[0], env.observations([0])[0])
    ids = trial.request().prompt_ids
    targets = np.concatenate([ids[1:], [RIGHT]]).astype(np.int32)
    lp = _logprobs(model, jnp.asarray(ids[None]), jnp.asarray(targets[None]))
    return float(np.exp(np.asarray(lp)[0, -1]))


MICRO = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)


@pytest.fixture(scope="module")
def shared() -> dict:
    """Compiled pieces reused by the four runs: the collector's sampler and the jitted update/log-probs
    (neither depends on the estimator), so each compiles once."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["sa_grpo", "grpo", "rloo", "gigpo"])
def test_the_rewarded_action_becomes_likely(estimator, tmp_path, shared):
    cfg = config(estimator, tmp_path)
    model = Qwen3(MICRO, rngs=nnx.Rngs(0))
    start = p_right(model, cfg)
    collect = shared.setdefault("collect", Collect(cfg))
    collect.cfg = cfg
    trainer = Trainer(cfg, model, WordTokenizer(), collect=collect, num_tasks=4, tensorboard=False,
                      progress=False)
    if "update" in shared:
        trainer.update, trainer.logprobs = shared["update"], shared["logprobs"]
    shared["update"], shared["logprobs"] = trainer.update, trainer.logprobs
    history = trainer.fit()
    end = p_right(trainer.model(), cfg)
    first = history[0]["rollout/results/T@3/success"]
    last = history[-1]["rollout/results/T@3/success"]
    assert start < 0.2, start
    assert end > start + 0.3, (start, end, [h.get("train/loss") for h in history])
    assert last > first, (first, last)


class Replay:
    """A collect that hands back one archive recorded by the real loop (the same trials every update)."""

    def __init__(self, archive, metrics):
        self.archive, self.metrics = archive, metrics

    def __call__(self, model, tasks, seeds):
        return self.archive, self.metrics


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple:
    """T@3 trials of a fresh micro model on the one-step world, recorded once by the real runner."""
    cfg = config("sa_grpo", tmp_path_factory.mktemp("rec"))
    model = Qwen3(MICRO, rngs=nnx.Rngs(1))
    archive, metrics = Collect(cfg)(model, [0, 1, 2, 3], [11, 12, 13, 14])
    return archive, metrics


# Jitted updates of _one_update's trainers, by their learn settings less the two that only cut the batch
# (max_batch_tokens, layout): trainers that differ in those alone share one update's compiled programs
_UPDATES: dict[str, tuple] = {}


def _one_update(recorded, tmp_path, **learn) -> tuple[Trainer, dict]:
    cfg = config("sa_grpo", tmp_path)
    cfg = dataclasses.replace(cfg, learn=dataclasses.replace(cfg.learn, **learn))
    trainer = Trainer(cfg, Qwen3(MICRO, rngs=nnx.Rngs(2)), WordTokenizer(), collect=Replay(*recorded),
                      num_tasks=4, tensorboard=False, progress=False)
    key = repr(dataclasses.replace(cfg.learn, max_batch_tokens=0, layout="rows"))
    trainer.update, trainer.logprobs = _UPDATES.setdefault(key, (trainer.update, trainer.logprobs))
    history = trainer.fit(updates=learn.get("updates", 1))
    return trainer, history[-1]


def test_the_step_does_not_depend_on_microbatch_size(recorded, tmp_path):
    """Microbatches are a memory device: one update cut into many small microbatches or one large one
    takes the same step (parameters within 1e-5, see below); the token-tree layout takes it too."""
    small, h_small = _one_update(recorded, tmp_path / "s", max_batch_tokens=128, layout="rows")
    large, h_large = _one_update(recorded, tmp_path / "l", max_batch_tokens=65536, layout="rows")
    tree, h_tree = _one_update(recorded, tmp_path / "t", max_batch_tokens=128, layout="tree")
    assert h_small["batch/microbatches"] > h_large["batch/microbatches"] >= 1
    assert h_small["train/optimizer_steps"] == h_large["train/optimizer_steps"] == 1.0
    assert h_tree["train/optimizer_steps"] == 1.0
    # Adam's first step divides by |g|, so an element whose gradient is ~0 can amplify float summation-order
    # noise to ~lr·1e-1 (measured: 1 of 2048 elements at 2.4e-5 with lr 2e-2); every other element is < 1e-5
    for other in (large, tree):
        for a, b in zip(jax.tree.leaves(small.params), jax.tree.leaves(other.params), strict=True):
            diff = np.abs(np.asarray(a) - np.asarray(b))
            assert np.mean(diff > 1e-5) < 0.01 and diff.max() < 1e-4
    assert h_small["train/loss"] == pytest.approx(h_large["train/loss"], rel=1e-5, abs=1e-7)


def test_the_schedule_counts_the_optimizer_steps_taken(recorded, tmp_path):
    """epochs × minibatches steps per update, and the schedule is sized in exactly the steps taken: a cosine
    schedule reaches 0 at the run's last step, not inside the first update."""
    trainer, last = _one_update(recorded, tmp_path, updates=3, epochs=2, minibatches=2,
                                lr_schedule="cosine", warmup_steps=2, max_batch_tokens=128)
    assert [h["train/optimizer_steps"] for h in trainer.history] == [4.0, 4.0, 4.0]
    assert trainer.optimizer_steps == trainer.schedule_steps == 12
    counts = [int(x) for x in jax.tree.leaves(trainer.opt_state) if np.ndim(x) == 0
              and np.issubdtype(np.asarray(x).dtype, np.integer)]
    assert counts and all(c == 12 for c in counts)  # optax's own step counters agree
    lrs = [h["lr"] for h in trainer.history]
    assert lrs[0] > 0 and lrs[1] > 0 and lrs[0] > lrs[1] > lrs[2] >= 0  # decays across updates


def test_a_warmup_keeps_the_first_update_near_its_start(recorded, tmp_path):
    """Adam's first step moves every weight by about lr·sign(g): from a fresh optimizer, one update of four
    steps drifts far from the behaviour policy (in the demo one token's log-prob fell 13 nats after the first
    step and a later step's KL term had a gradient norm of 1.1e4); a linear warmup over that update keeps it
    close."""
    learn = dict(epochs=2, minibatches=2, kl_coef=0.05, max_batch_tokens=4096)
    _, cold = _one_update(recorded, tmp_path / "cold", warmup_steps=0, **learn)
    _, warm = _one_update(recorded, tmp_path / "warm", warmup_steps=4, **learn)
    assert warm["train/optimizer_steps"] == cold["train/optimizer_steps"] == 4.0
    for key in ("train/approx_kl", "train/loss_kl"):  # measured: 9x and 25x smaller
        assert warm[key] < cold[key] / 3, (key, warm[key], cold[key])


def test_a_fresh_run_in_a_used_directory_keeps_the_old_log_apart(recorded, tmp_path):
    """`make demo` twice writes to one directory: the second run's log starts empty and the first run's is
    kept beside it (metrics.jsonl.1), never appended to."""
    first, _ = _one_update(recorded, tmp_path)
    second, _ = _one_update(recorded, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl.1").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in kept] == [1.0]
    assert rows == second.history and kept == first.history
