"""Compiled programs per stage (retrojax.programs): JAX's monitoring events count a fresh compile once and a
repeat call not at all, a persistent-cache hit apart as cached; a count above a stage's bound warns; the
bounds (sampler, learner microbatches, SFT batches) hold the shapes their own shape rules produce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retrojax import programs
from retrojax.learn import sft
from retrojax.learn.layout import from_example, microbatch_shapes, pack
from retrojax.model.qwen3 import Qwen3, Qwen3Config
from retrojax.programs import Bound, Ledger
from retrojax.sampler import Sampler


def _scaled_by_seven(x):
    return x * 7.0 + 1.0


def test_a_fresh_compile_counts_once_and_a_repeat_call_not_at_all():
    ledger = Ledger()
    ledger.bound("first", Bound(1, ("_scaled_by_seven",)))
    f = jax.jit(_scaled_by_seven)
    x = jnp.arange(13.0)  # a shape no other test compiles this function for
    with ledger.stage("first"):
        f(x).block_until_ready()
    with ledger.stage("again"):
        f(x).block_until_ready()
    first = ledger.count("first")
    assert first.programs == 1 and first.bound.programs == 1 and not first.over
    assert "_scaled_by_seven" not in ledger.by_name("again")  # the in-memory cache: nothing compiled
    m = ledger.metrics()
    assert m["programs.first.bound"] == 1.0 and m["programs.first.compiled"] + m["programs.first.cached"] == 1
    assert "programs.again.bound" not in m and m["programs.again.compiled"] == 0.0


def test_a_stage_past_its_bound_warns_and_names_the_stage():
    ledger = Ledger()
    ledger.bound("tight", Bound(0, ("_scaled_by_seven",)))
    f, x = jax.jit(_scaled_by_seven), jnp.arange(17.0)
    with ledger.stage("tight"):
        f(x).block_until_ready()
    lines: list[str] = []
    ledger.log(lines.append)
    assert lines[0].startswith("programs: tight ") and lines[0].endswith("; bound 0; 0 other (0.0 s)")
    assert ledger.count("tight").over and ledger.count("tight").programs == 1
    assert any(line.startswith("warning: stage tight needed 1 programs, above its bound of 0")
               for line in lines)


_TWICE = textwrap.dedent("""
    import json, jax, jax.numpy as jnp
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from retrojax.programs import Ledger
    def cubed_plus_two(x):
        return x ** 3 + 2.0
    ledger = Ledger()
    for stage in ("cold", "warm"):
        with ledger.stage(stage):
            jax.jit(cubed_plus_two)(jnp.arange(5.0)).block_until_ready()
        jax.clear_caches()  # the next call finds nothing in memory: the persistent cache answers
    tally = {s: ledger.by_name(s)["cubed_plus_two"] for s in ("cold", "warm")}
    print(json.dumps({s: [t.compiled, t.cached] for s, t in tally.items()}))
""")


def test_persistent_cache_hits_are_counted_as_cached(tmp_path):
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _TWICE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts == {"cold": [1, 0], "warm": [0, 1]}


CFG = Qwen3Config(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256)


def test_the_sampler_compiles_within_its_bound_per_function():
    sampler = Sampler(Qwen3(CFG, rngs=nnx.Rngs(0)), rows=3, max_len=72, chunk_buckets=(8, 24),
                      min_window=16, min_out_len=4)
    bounds = sampler.program_bounds()
    assert sampler.windows() == (16, 32, 64, 72)
    assert (bounds["_prefill_impl"], bounds["_decode_impl"], bounds["_next_logits_impl"]) == (4 * 2, 4, 4)
    ledger = Ledger()
    rng = np.random.default_rng(0)
    with ledger.stage("sample"):
        for n, new in ((5, 6), (20, 10), (30, 20)):  # windows 16, 32 and 64; chunk buckets 8 and 24
            sampler.append([0, 1], [rng.integers(0, 61, n), rng.integers(0, 61, n // 2 + 1)])
            sampler.generate([0, 1], new, key=jax.random.key(n))
            sampler.reset(0)
            sampler.reset(1)
    used = ledger.by_name("sample")
    # three windows met: a prefill and a decode in each (both chunks of a call share one bucket width)
    assert {k: used[k].compiled + used[k].cached for k in ("_prefill_impl", "_decode_impl")} == {
        "_prefill_impl": 3, "_decode_impl": 3}
    for name, bound in bounds.items():
        t = used.get(name)
        assert t is None or t.compiled + t.cached <= bound, (name, t, bound)


def _items(rng: np.random.Generator, n: int, longest: int):
    out = []
    for _ in range(n):
        ids = rng.integers(0, 50, int(rng.integers(3, longest))).astype(np.int32)
        own = np.zeros(ids.size, bool)
        own[ids.size // 2:] = True
        out.append(from_example(ids, own))
    return out


def test_microbatch_shapes_hold_every_shape_the_layouts_pack():
    rng = np.random.default_rng(1)
    lengths, budget = (16, 32, 64), 256
    for layout, opts in (("packed", {"share": False}), ("tree", {}), ("tree_long", {"long_rows": True})):
        allowed = set(microbatch_shapes(layout, lengths, budget))
        for n in (1, 3, 9, 30):
            packing = pack(_items(rng, n, 60), lengths=lengths, max_batch_tokens=budget, **opts)
            assert set(packing.shapes()) <= allowed, (layout, n)
    assert {(r, b) for r, b, _ in microbatch_shapes("rows", lengths, budget)} == {
        (r, b) for b in lengths for r in (1, 2, 4, 8, 16) if r * b <= max(budget, b)}


def test_sft_batch_shapes_hold_every_batch_make_batch_builds():
    rng = np.random.default_rng(2)
    buckets = (16, 32, 64)
    for layout in ("rows", "packed", "tree"):
        allowed = set(sft.batch_shapes(4, buckets, layout))
        for n in (1, 2, 3, 4):
            examples = [sft.Example(ids=it.tokens, own=np.ones(it.tokens.size, bool))
                        for it in _items(rng, n, 60)]
            batch = sft.make_batch(examples, 4, buckets, layout=layout)
            k = batch["term_node"].shape[1] if "term_node" in batch else 0
            assert (*batch["input_ids"].shape, k) in allowed, (layout, n)


def test_base_name_reads_every_spelling_of_a_program_name():
    assert {programs.base_name(n) for n in ("jit(_decode_impl)", "jit__decode_impl", "_decode_impl")} == {
        "_decode_impl"}
