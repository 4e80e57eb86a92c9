"""The ``retrojax`` command line.

Every subcommand is declared here (flags and help) and dispatched lazily to a handler
``module:function`` taking the parsed ``argparse.Namespace`` and returning an exit code, so that
``retrojax --help`` stays fast and each part of the library owns its own handler module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def _add_config_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--config", default=default, help="YAML config under configs/ (or any path)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config field, e.g. --set trial.max_calls=40 (repeatable)",
    )


def _add_device_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="plan for a device of this memory, e.g. 80GB (default: what the device reports; "
                        "the host's RAM on CPU)")


def _handler(target: str):
    def run(args: argparse.Namespace) -> int:
        module, func = target.split(":")
        return int(getattr(importlib.import_module(module), func)(args) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retrojax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    # --- bench -------------------------------------------------------------------------------
    bench = sub.add_parser("bench", help="print speed figures under stable keys")
    bench_sub = bench.add_subparsers(dest="bench_target", required=True)
    for name, target, help_ in [
        ("envs", "retrojax.bench.envs:main", "functional environments: steps/s, rewind, generation"),
        ("sampler", "retrojax.bench.sampler:main", "KV-cache sampler vs transformers and re-prefill"),
        ("update", "retrojax.bench.update:main", "jitted GRPO update vs bare forward+backward"),
        ("textworlds", "retrojax.bench.textworlds:main", "ScienceWorld / ALFWorld bridge"),
        ("serve", "retrojax.bench.serve:main", "retrojax serve: tokens/s, 1/8/32 clients vs one at a time"),
        ("learn", "retrojax.bench.learn:main", "SFT then K ReTRAIL updates on CPU: does success rise?"),
        ("parallel", "retrojax.bench.parallel:main", "mesh: per-device FLOPs/memory, collectives, 4B plan"),
        ("lora", "retrojax.bench.lora:main", "LoRA decode: merged weights vs adapters per step"),
        ("credit", "retrojax.bench.credit:main", "one RL batch: mean advantage by group and move quality"),
        ("device", "retrojax.bench.device:main", "accelerator: forest kernel, update MFU, prefill/decode"),
        ("realshape", "retrojax.bench.realshape:main", "Qwen3-0.6B shape end to end on CPU, vs transformers"),
        ("reviewer", "retrojax.bench.reviewer:main", "a trained policy in every RIR role: parse, RIR-ReAct"),
    ]:
        p = bench_sub.add_parser(name, help=help_)
        p.add_argument("--json", default=None, help="also write the figures to this JSON file")
        p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
        p.set_defaults(func=_handler(target))
        if name == "credit":
            p.add_argument("--policy", default="oracle:0.9", metavar="POLICY",
                           help="oracle:EPS or model:DIR (default: oracle:0.9)")
            p.add_argument("--tasks", type=int, default=64, help="training levels in the batch (default 64)")
            p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                           help="override a field of configs/demo.yaml (repeatable)")
        if name == "reviewer":
            p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                           help="override a field of configs/rir_reviewer.yaml (repeatable)")
            p.add_argument("--baselines", action="store_true",
                           help="also demonstrate and evaluate the RIR paper's baselines (Self-Refine, "
                                "Reflexion, LATS, GA-Rollback) with the trained policy in their roles")
            p.add_argument("--credit", type=int, default=0, metavar="UPDATES",
                           help="then train the policy this many updates on RIR trials with reviewer credit "
                                "and without it (the control), from the same start: RIR - ReAct of each")
        if name == "learn":
            p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                           help="override a field of configs/demo.yaml (repeatable)")
            p.add_argument("--recipe", choices=("pool", "transfer"), default="pool",
                           help="pool (default): RL on the demo's 4 training rooms; transfer: RL on all "
                                "training rooms from a start that reads unseen ones, 128 rooms held out")
            p.add_argument("--compare", action="store_true",
                           help="ReTRAIL vs forward-only GRPO vs more SFT from one SFT start (held-out "
                                "P@1/T@1/T@3 with paired differences)")

    # --- play --------------------------------------------------------------------------------
    play = sub.add_parser("play", help="play an environment in the terminal")
    play_sub = play.add_subparsers(dest="env", required=True)
    for name, split in [("sokoban", "sokoban-6x6-2:test"), ("minesweeper", "minesweeper-6x6-3:test")]:
        p = play_sub.add_parser(name)
        p.add_argument("--split", default=split, help="registered split NAME:train|test|val")
        p.add_argument("--index", type=int, default=0, help="level index within the split")
        p.set_defaults(func=_handler(f"retrojax.play.{name}:main"))

    # --- generate ----------------------------------------------------------------------------
    gen = sub.add_parser("generate", help="chat-formatted generation from a local checkpoint")
    gen.add_argument("--model", required=True, help="directory with config.json + safetensors")
    gen.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory to put on --model")
    gen.set_defaults(func=_handler("retrojax.generate:main"))

    # --- serve -------------------------------------------------------------------------------
    srv = sub.add_parser("serve", help="OpenAI-compatible chat server over a local checkpoint")
    srv.add_argument("--model", required=True, help="directory with config.json + safetensors")
    srv.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    srv.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory to serve on --model")
    srv.add_argument("--name", default=None, help="model id clients ask for (default: the directory name)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch", type=int, default=16, help="requests decoded together (sampler rows)")
    srv.add_argument("--max-len", type=int, default=2048, help="context per request: prompt + reply tokens")
    srv.add_argument("--decode-chunk", type=int, default=4,
                     help="decode steps between admissions (a new request waits at most this many)")
    srv.add_argument("--row-buckets", default=None,
                     help="comma-separated row counts programs run on, e.g. 1,4,16,64 (default: powers of "
                          "two up to --max-batch; fewer buckets: fewer compiles, more padded rows)")
    srv.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--log-level", default="warning")
    srv.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                     help="compile every row-bucket program before reporting ready (default on; "
                          "--no-warmup: compile each on its first request)")
    srv.add_argument("--keep-alive", type=int, default=None, metavar="SECONDS",
                     help="idle keep-alive connections stay open this long (default 75: longer than clients "
                          "pool them, 5 s for httpx/openai, so the server never closes one a client reuses)")
    _add_device_memory(srv)
    srv.set_defaults(func=_handler("retrojax.serve.app:main"))

    # --- eval --------------------------------------------------------------------------------
    ev = sub.add_parser("eval", help="run trials with a policy under protocols and report success")
    _add_config_args(ev, default="configs/sokoban.yaml")
    _add_device_memory(ev)
    ev.add_argument("--policy", default="oracle:0.3",
                    help="random | notes (Sokoban's push notes followed) | oracle:EPS | model:DIR | "
                         "api:MODEL (the api: section's endpoint)")
    ev.add_argument("--protocol", action="append", default=None,
                    help="P@1 | T@1 | T@3 | T@k (repeatable or comma-separated)")
    ev.add_argument("--split", default=None, help="NAME:train|test|val (default: the config's)")
    ev.add_argument("--seeds", type=int, default=3)
    ev.add_argument("--tasks", type=int, default=None, help="limit the number of tasks")
    ev.add_argument("--json", default=None)
    ev.add_argument("--transcripts", default=None, metavar="FILE",
                    help="write one JSON line per model call (agent and auxiliary): protocol, task, seed, "
                         "trial, call, role, messages, reply")
    ev.set_defaults(func=_handler("retrojax.eval.protocol:main"))

    # --- rir ---------------------------------------------------------------------------------
    rir = sub.add_parser("rir", help="RIR report: main / when / where / components / range tables")
    _add_device_memory(rir)
    rir.add_argument("--config", action="append", required=True,
                     help="a world's YAML config (repeatable or comma-separated: one column per world)")
    rir.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field in every world, e.g. --set rir.rollback_budget=5")
    rir.add_argument("--table", default="all",
                     help="main | when | where | components | range | all (or a comma list)")
    rir.add_argument("--out", default="runs/rir", help="folder for report.md, summary.json and the heat map")
    rir.add_argument("--policy", default="oracle:0.3",
                     help="random | oracle:EPS | model:DIR | api:MODEL (the api: section's endpoint)")
    rir.add_argument("--split", default=None, help="NAME:train|test|val (default: the config's test split)")
    rir.add_argument("--seeds", type=int, default=3)
    rir.add_argument("--tasks", type=int, default=None, help="limit the number of tasks")
    rir.add_argument("--trials-per-task", type=int, default=None, help="replicates per task and seed")
    rir.add_argument("--protocol", default=None, metavar="P,Q,...",
                     help="run only these of the tables' protocols, e.g. RIR,RIR/react (default: all)")
    rir.add_argument("--transcripts", default=None, metavar="FILE",
                     help="write one JSON line per model call (agent and auxiliary, every variant)")
    rir.set_defaults(func=_handler("retrojax.eval.rir.report:main"))

    # --- train -------------------------------------------------------------------------------
    tr = sub.add_parser("train", help="ReTRAIL training (State-Anchored GRPO)")
    _add_config_args(tr, default="configs/sokoban_tiny.yaml")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    _add_device_memory(tr)
    tr.set_defaults(func=_handler("retrojax.learn.cli:main"))

    # --- plan --------------------------------------------------------------------------------
    pl = sub.add_parser("plan", help="compile-only memory plan: what fits one device (no weights needed)")
    _add_config_args(pl)
    pl.add_argument("--device-memory", default="80GB", help="memory of one device, e.g. 80GB, 141GiB")
    pl.add_argument("--json", default=None, help="also write the figures to this JSON file")
    pl.add_argument("--no-compare", action="store_true", help="skip the other route (full vs LoRA)")
    pl.set_defaults(func=_handler("retrojax.plan.cli:main"))

    # --- demo --------------------------------------------------------------------------------
    demo = sub.add_parser("demo", help="the built-in default: SFT + ReTRAIL RL on small Sokoban, on CPU")
    _add_config_args(demo, default="configs/demo.yaml")
    demo.set_defaults(func=_handler("retrojax.demo:main"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from retrojax.host_memory import keep_freed_memory

    keep_freed_memory()  # before XLA starts threads: reuse freed host memory (RETROJAX_MALLOC=system: off)
    args = build_parser().parse_args(argv)
    from retrojax.parallel.distributed import enable_compile_cache_default

    enable_compile_cache_default()  # JAX's persistent compilation cache (RETROJAX_COMPILE_CACHE=0: off)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
