"""Typed configuration: YAML files loaded into frozen dataclasses.

Each section of a run's configuration is a frozen dataclass; ``load(path, overrides)`` reads a YAML
file, applies ``--set a.b=c`` overrides, and builds the dataclasses, rejecting unknown keys and values
of the wrong type with an error that names the key and the file. Sections are declared here so that a
run's whole configuration is readable in one place; the modules that consume them own the meaning.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------

# how the learner (learn.layout) and SFT (sft.layout) lay sequences out in rows (retrojax.learn.layout)
Layout = Literal["rows", "packed", "tree", "tree_long"]


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Which world, which tasks."""

    name: str = "sokoban"  # sokoban | minesweeper | scienceworld | alfworld
    split: str = "sokoban-6x6-2"  # registered split name (train/test selected by the job)
    cache_dir: str | None = None  # where generated level banks are cached (default: user cache)
    num_tasks: int | None = None  # use only the first N tasks of a split (None = all)
    text_workers: int = 2  # worker processes for host-side text worlds
    step_timeout_s: float = 30.0
    data_dir: str | None = None  # real ALFWorld games (standard layout) for split alfworld-data:PART
    text_step_limit: int = 100  # ScienceWorld: moves before an episode ends (as its wrapper)
    board_notes: bool = False  # Sokoban, ours (tiny models): a line per box: its place from you, its target
    push_notes: bool = False  # Sokoban, ours (tiny models): where to stand for a push to a target; free moves


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The policy: a local Hugging Face checkpoint, or a built-in small Qwen3."""

    path: str | None = None  # local checkpoint directory; None = build the preset
    tokenizer: str | None = None  # tokenizer directory; default: `path`
    preset: str = "tiny"  # qwen3-0.6b | qwen3-1.7b | qwen3-4b | qwen3-8b | tiny | demo | small
    dtype: str = "float32"  # float32 | bfloat16
    seed: int = 0
    adapter: str | None = None  # a PEFT LoRA adapter directory to put on the base (retrojax.model.peft)
    # ours: the attention of the learner (Qwen3.hidden) and of the KV cache's prefill and decode
    # (retrojax.model.qwen3.attention_kind). xla: the einsum blocks; fused: jax.nn.dot_product_attention
    # (cuDNN flash attention on GPU where it applies, XLA's implementation elsewhere); pallas: the Pallas
    # kernels (retrojax.kernels; interpret mode on CPU): forest flash attention for the learner, paged
    # attention for the paged cache's prefill and decode, fused for the dense cache; auto: xla on cpu, on
    # gpu/tpu the kernels for token forests and the paged cache, fused for rows and the dense cache
    attention: Literal["auto", "xla", "pallas", "fused"] = "auto"


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Decoding and the KV cache."""

    max_len: int = 4096  # cache length per row (tokens)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256  # per execution call
    max_reflection_tokens: int = 384  # per reflection call
    chunk_buckets: tuple[int, ...] = (32, 128, 512, 2048)
    # trials in flight per sampler (KV-cache rows); 0 = all trials of a batch at once; auto = the most rows
    # that fit the device beside the run's weights, optimizer and activations (retrojax.plan.admission: train,
    # eval, rir and serve resolve it before allocating; unresolved, e.g. from Python, it means 0)
    max_inflight: int | Literal["auto"] = "auto"
    # ours, off: each generate call runs on its own rows padded to a power of two (the serve engine's row
    # buckets) instead of every cache row: a tick's few reflections no longer pay for all rows. Sampled
    # replies draw other random numbers than with it off (greedy ones are the same)
    row_buckets: bool = False
    # ours: paged | dense. paged: keys/values in a pool of fixed-size pages, a page table per row, a task's
    # shared prompt pages stored once (retrojax.sampling.pages, docs/paged-cache.md); dense: max_len slots per
    # row. The same tokens and log-probs either way
    kv: str = "paged"
    # ours, paged only: pages in the pool (retrojax.sampling.pages.PAGE_SIZE slots each); auto = what the
    # device holds beside the run once its rows' temporaries are counted (retrojax.plan.admission), at most
    # every row at max_len. A call that needs more pages than are free evicts other rows (recomputed later)
    kv_pages: int | Literal["auto"] = "auto"
    # ours: decode over per-layer copies of the layer weights, unrolled (true), or one scanned layer body
    # over the stacked weights, no copies (false); auto: true on cpu only (retrojax.model.qwen3.
    # use_layer_copies: XLA:CPU copies a stacked weight's slice per step, an accelerator reads it in place)
    layer_copies: bool | Literal["auto"] = "auto"

    def inflight_rows(self) -> int:
        """``max_inflight`` as a row limit: 0 (every trial of a batch) while ``auto`` is unresolved."""
        return 0 if self.max_inflight == "auto" else int(self.max_inflight)


@dataclasses.dataclass(frozen=True)
class TrialConfig:
    """ReTRAIL's budgets and protocol for one trial (Algorithm 1)."""

    protocol: str = "T@3"  # P@1 | T@1 | T@k
    max_calls: int = 60  # global ceiling, execution + reflection, never refunded
    branch_budget: int = 20  # execution turns on the active path; restored on rewind
    max_model_rewinds: int = 3
    min_calls_for_recovery: int = 2
    fallback: str = "latest"  # latest | end: when a forced reflection names no valid target
    remark_max_chars: int = 4800
    prompt_style: str = "full"  # full | compact
    trials_per_task: int = 8  # B: trials of one task form a group
    history_events: int = 4  # branch events shown in each user turn
    p1_max_turns: int = 0  # P@1 only: cap on execution turns (0: off, the 60-call ceiling alone; ours)
    max_segments: int = 0  # forward-segment cap counting both recovery types (C.4; 0: off)
    # reflection (the paper) | raw_suffix (ablation: the abandoned suffix, no call)
    memory: str = "reflection"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (retrojax.model.lora); rank 0 = full fine-tuning. Defaults are ours, not the paper's."""

    rank: int = 0  # adapter rank r; > 0 trains only the adapters (the base is frozen)
    alpha: float = 32.0  # scale = alpha / rank, as PEFT and qwix
    dropout: float = 0.0  # on the adapter path's input while training
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")  # Qwen3 projections
    dtype: str = "float32"  # the adapters' dtype (the base keeps model.dtype)


@dataclasses.dataclass(frozen=True)
class LearnConfig:
    """State-Anchored GRPO and the optimizer."""

    estimator: str = "sa_grpo"  # sa_grpo | grpo | rloo | gigpo | gigpo_retro
    reflection_reward: str = "advancement"  # advancement | v_plus_only
    lambda_state: float = 1.0
    lambda_ref: float = 0.5
    gamma: float = 1.0
    norm_eps: float = 1e-6
    # NOT in the paper (C.2: no transition means δ = 0): reward added to each invalid execution turn's δ,
    # its segment's S and its trial's outcome; 0 = the paper's rule (see learn/advantages.py)
    invalid_penalty: float = 0.0
    # segment: a rewind request's return is its own δ = 0 (the paper, D.5.2) | resumed (ours): a rewind's
    # return continues into the branch it resumes (+ γ·G of its first decision); see learn/advantages.py
    rewind_return: Literal["segment", "resumed"] = "segment"
    # S of the macro term and the trial outcome of the trajectory estimators: progress (the paper's "endpoint
    # progress": the world's, Sokoban's d_0 − d_end of C.2, the cumulative reward elsewhere) | reward (the
    # cumulative reward along the retained path, which for Sokoban ranks failed segments by fewest moves)
    task_score: Literal["reward", "progress"] = "progress"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    updates: int = 100
    tasks_per_update: int = 4
    train_tasks: int | None = None  # RL draws its tasks from the first N training levels (None = all of them)
    # ours: RL plays only training levels whose reference solution length is in [lo, hi] (the first
    # train_tasks of them; None = every length): a pool at the policy's frontier (retrojax.learn.pool)
    pool_lengths: tuple[int, ...] | None = None
    minibatches: int = 1
    logprob_chunk: int = 512
    seq_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    lr_schedule: str = "constant"  # constant | cosine (after warmup)
    epochs: int = 1  # passes over each batch of trials (one optimizer step per minibatch per pass)
    max_batch_tokens: int = 16384  # rows x length of one microbatch (a memory bound: gradients are summed
    #                                over a minibatch's microbatches, so it does not change the step)
    old_logprobs: str = "sampler"  # sampler | recompute: which log-probs of θ_old the ratio uses
    check_logprobs: bool = True  # recompute θ_old log-probs and log their gap to the sampler's
    chain_segments: bool = True  # one sequence per segment when the conversation only grew
    track_kl_ref: bool = True  # keep the start policy to log diag/kl_ref each update (one params copy)
    # rows: one padded sequence per row | packed: sequences packed into rows | tree: packed, shared prefixes
    # laid out once as a token tree (retrojax.learn.layout), rows of the longest seq_bucket | tree_long: tree
    # in rows up to max_batch_tokens (a whole task tree per row, block-sparse attention past 4096 tokens)
    layout: Layout = "tree_long"
    # rematerialize layers in the backward pass: true | false | auto (on when the memory plan says the
    # update would not fit the device without it; retrojax.plan)
    remat: bool | str = "auto"
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    checkpoint_every: int = 1  # updates between checkpoints
    # ours: float32 | model. float32 keeps float32 master weights, AdamW moments and gradient sums beside a
    # bfloat16 model (a 1e-6 step of a bfloat16 weight rounds to zero); model steps the weights in the model's
    # dtype (half the optimizer memory, knowingly). SFT follows it too (retrojax.learn.precision)
    master_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    protocols: tuple[str, ...] = ("P@1", "T@1", "T@3")
    every: int = 0  # evaluate every N updates during training (0 = only at the end)
    num_tasks: int | None = 32
    seeds: int = 1
    # ours: the demo also scores the SFT and the RL policy with greedy decoding (one seed): a held-out gain at
    # the sampling temperature that vanishes here is sharpening, not more boards read
    greedy: bool = False
    # ours: the part of env.split the demo and `bench learn` hold out: "test" reports, "val" tunes (the parts
    # share no room, so a setting chosen on val is judged once on test)
    held_out: Literal["test", "val"] = "test"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs/default"
    seed: int = 0
    keep_checkpoints: int = 3
    log_every: int = 1


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Warm start on demonstrations (the demo runs it when steps > 0; ``retrojax train`` when warm_start)."""

    warm_start: bool = False  # retrojax train: SFT on oracle demonstrations before the RL updates
    steps: int = 300
    batch_size: int = 16
    learning_rate: float = 1e-3
    seq_len: int = 512
    num_solver_episodes: int = 256
    num_recovery_episodes: int = 128
    vocab_size: int = 2000
    oracle_epsilon: float = 0.3  # recovery demonstrations: the oracle's chance of a random move
    warmup_steps: int = 10
    demo_tasks: int | None = None  # ours: demonstrations on the first N training levels (None: the RL pool,
    #                                learn.train_tasks and learn.pool_lengths, or every level without them)
    # ours (demo stack): stop once the policy solves this share of the RL pool's trials and this share of its
    # levels at least once (None: no condition; both None: run sft.steps, otherwise the most), checked every
    # check_every steps from check_from
    stop_at_success: float | None = None
    stop_at_levels: float | None = None
    check_from: int = 150
    check_every: int = 25
    # ours: > 0 makes a stop-rule run warmup-stable-decay: each check judges a branch annealed over this many
    # steps (0: the cosine run's current weights, whose rate a stop leaves mid-way)
    check_anneal: int = 0
    # ours: the loss weight of the tokens inside a reply's <action>…</action> relative to its other tokens
    # (1.0: every trained token alike). A reply is ~12 format tokens around one move, and under the plain
    # token mean the move was not learned off the pool (docs/findings.md; 2026-12-05, commit 25809cb)
    decision_weight: float = 1.0
    # how SFT lays out a step's examples (learn.layout's values; null: learn.layout). On CPU tree beat
    # tree_long for SFT in both measurements: fewer step programs to compile (3 vs 7 in bench update's 20
    # steps; 5 vs 11 in the demo's 225) and less time per step (2026-12-06, commit 848296c)
    layout: Layout | None = None


@dataclasses.dataclass(frozen=True)
class RIRConfig:
    """RIR (retrojax.agent.rir): paper defaults (L_min, L_max) = (4, 8); the rest are our choices."""

    l_min: float = 4.0
    l_max: float = 8.0
    l_0: float = 4.0  # horizon at the start and after every rollback (our choice: L_min)
    default_urgency: float = 0.5  # a malformed urgency ρ
    rollback_budget: int = 3  # B_rb (our choice)
    agent_budget: int = 60  # B_agent: agent replies per task (our choice: ReTRAIL's 60-call ceiling)
    aux_counts_against_agent: bool = False  # auxiliary calls are counted separately (our choice)
    review_on_failure: bool = True  # review an irreversible failure before the trial ends
    prompt_budget: int = 3072  # tokens per auxiliary prompt (review, coarse, patch): older steps give way
    observation_chars: int = 800  # a raw observation longer than this is shown as the world's summary σ
    min_calls_for_restore: int = 2  # refuse a restore with fewer agent calls left (ReTRAIL's floor)
    max_review_tokens: int = 384
    max_select_tokens: int = 96
    max_patch_tokens: int = 384
    # ours: the local model's sampling temperature for the auxiliary roles (RIR's and the baselines'); None:
    # sampler.temperature. A served model's are api.<kind>.temperature
    aux_temperature: float | None = None
    oracle_noise: float = 0.0  # scripted oracle reviewer: chance of flipping a verdict
    oracle_stall: int = 4  # scripted oracle reviewer: steps without progress that count as a stall
    range_l_min: tuple[int, ...] = (2, 4, 6)  # the (L_min, L_max) sweep of `retrojax rir --table range`
    range_l_max: tuple[int, ...] = (6, 8, 12)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The (data, fsdp, tp) device mesh (retrojax.parallel); -1 fills one axis with the devices left."""

    data: int = 1  # outermost axis: crosses hosts (devices are ordered by process)
    fsdp: int = -1  # weights' embed dim and batch rows
    tp: int = 1  # heads / mlp / vocab
    rules: tuple[str, ...] = ()  # logical-axis overrides, e.g. ["embed=none", "batch=data+fsdp"]
    strict: bool = False  # raise when a rule cannot divide a dimension instead of replicating it


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs through jax.distributed (one process per host or per GPU)."""

    # auto (when a coordinator or a cluster is detected) | on | off (YAML reads a bare on/off as a bool)
    initialize: str | bool = "auto"
    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    cpu_collectives: str = "gloo"  # CPU-only runs: gloo | mpi
    compile_cache: bool = True  # JAX's persistent compilation cache
    compile_cache_dir: str | None = None  # default: <user cache dir>/retrojax/jax


@dataclasses.dataclass(frozen=True)
class ApiCallConfig:
    """One kind of served-model call (retrojax.agent.api_policy); None takes the api section's default."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None  # None: the section's max_tokens, else the request's own limit
    stop: tuple[str, ...] | None = None  # None: api.stop for execution/reflection, none for RIR's aux roles


@dataclasses.dataclass(frozen=True)
class ApiConfig:
    """``--policy api:MODEL``: an OpenAI-compatible chat endpoint (vLLM, SGLang, hosted, retrojax serve)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # default model name (--policy api:MODEL wins)
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the key (unset: "EMPTY")
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: each request's own limit (sampler / rir token settings)
    stop: tuple[str, ...] = ("</action>",)
    enable_thinking: bool | None = None  # Qwen3 via chat_template_kwargs (vLLM, SGLang, serve); None: unsent
    concurrency: int = 8  # requests of one tick in flight at once
    timeout_s: float = 60.0  # per HTTP request
    retries: int = 3  # extra attempts after a 429 / 5xx / timeout / dropped connection / malformed reply
    backoff_s: float = 0.5  # first retry delay, doubled each time
    backoff_max_s: float = 8.0  # cap on one delay (also on a server's Retry-After)
    # a local copy of the served model's tokenizer (a directory): prompts are tokenized with it, so RIR's
    # auxiliary budgets (rir.prompt_budget) count its tokens as a local run does; None: ⌈UTF-8 bytes / 3⌉
    tokenizer: str | None = None
    execution: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    reflection: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    review: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    coarse: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    fine: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    patch: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    # the RIR paper's baselines' auxiliary kinds (Self-Refine's refine is an action turn: the default's)
    critique: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    reflect: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    value: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)
    assist: ApiCallConfig = dataclasses.field(default_factory=ApiCallConfig)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    trial: TrialConfig = dataclasses.field(default_factory=TrialConfig)
    learn: LearnConfig = dataclasses.field(default_factory=LearnConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    rir: RIRConfig = dataclasses.field(default_factory=RIRConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    api: ApiConfig = dataclasses.field(default_factory=ApiConfig)


# ----------------------------------------------------------------------------------------------
# Loading and validation
# ----------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    """An annotation as an error message names it: ``int | null``, ``one of rows | tree``."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + " | ".join(map(str, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert only lossless cases (int→float, list→tuple)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Literal:  # one of a fixed set of values (e.g. learn.layout)
        options = typing.get_args(tp)
        if any(type(value) is type(o) and value == o for o in options):
            return value
        raise ConfigError(f"{source}: key '{key}' expects one of {' | '.join(map(str, options))}, "
                          f"got {value!r}")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, key, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{source}: key '{key}' expects {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: key '{key}' is a section and expects a mapping, got {value!r}")
        return _build(tp, value, source, prefix=f"{key}.")
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: key '{key}' expects a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 (PyYAML) reads 1e-3 without a dot as a string
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{source}: key '{key}' expects {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Mapping[str, Any], source: str, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}' "
            f"(known in this section: {', '.join(sorted(names))})"
        )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}", source) for k, v in data.items()}
    return cls(**kwargs)


def _set_path(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: '{dotted}' goes through '{part}', which is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b=c``; the value is read as YAML so numbers, booleans, null and lists keep their type."""
    if "=" not in text:
        raise ConfigError(f"--set '{text}': expected KEY=VALUE, e.g. trial.max_calls=40")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def from_dict(data: Mapping[str, Any] | None, cls: type = Config, source: str = "<dict>") -> Any:
    return _build(cls, dict(data or {}), source)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, section by section (values in ``over`` win; lists are replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _with_base(data: dict[str, Any], path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file may start from another one: ``base: sokoban.yaml`` (relative to the file, else under
    configs/); its own keys override the base's (e.g. the ablations in configs/ablations/)."""
    if "base" not in data:
        return data
    name = data.pop("base")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: 'base' expects the path of another config file, got {name!r}")
    base = (path.parent / name).resolve()
    if not base.exists():
        base = Path(__file__).resolve().parent.parent / "configs" / name
    if not base.exists():
        raise ConfigError(f"{path}: base config not found: {name}")
    if base in seen:
        raise ConfigError(f"{path}: 'base' chain loops back to {base}")
    try:
        loaded = yaml.safe_load(base.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{base}: not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"{base}: the top level must be a mapping of sections")
    return _merge(_with_base(loaded, base, (*seen, path.resolve())), data)


def load(path: str | Path | None, overrides: Sequence[str] = (), cls: type = Config) -> Any:
    """Read a YAML config (or defaults when ``path`` is None), apply overrides, validate, freeze."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        if not p.exists():
            candidate = Path(__file__).resolve().parent.parent / "configs" / p.name
            if candidate.exists():
                p = candidate
            else:
                raise ConfigError(f"config file not found: {path}")
        source = str(p)
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
        data = _with_base(loaded, p)
    for text in overrides:
        key, value = parse_override(text)
        _set_path(data, key, value, f"--set {text}")
    return _build(cls, data, source if not overrides else f"{source} (with --set overrides)")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data view (for reports and checkpoints)."""
    return dataclasses.asdict(cfg)


def replace(cfg: Any, **sections: Any) -> Any:
    """``dataclasses.replace`` for nested sections: ``replace(cfg, trial={'max_calls': 10})``."""
    updates = {}
    for name, value in sections.items():
        current = getattr(cfg, name)
        updates[name] = dataclasses.replace(current, **value) if isinstance(value, Mapping) else value
    return dataclasses.replace(cfg, **updates)
