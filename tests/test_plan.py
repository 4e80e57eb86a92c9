"""``retrojax plan`` on a tiny config: compile-only figures under the documented keys, exit 1 with the reason
when a phase does not fit, ``learn.remat: auto`` resolution."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from retrojax.cli import main as cli
from retrojax.config import load
from retrojax.plan import resolve_remat
from retrojax.plan.bound import parse_bytes

KEYS = ("plan.fits", "plan.total_gb", "plan.params_gb", "plan.opt_gb", "plan.grads_gb", "plan.act_gb",
        "plan.kv_gb", "plan.remat", "plan.max_inflight_fit")
# An explicit page pool (every row at max_len, what ``auto`` gives on a large device) keeps the sampler's
# programs the same for every device size, so the plan of the small device reuses the first plan's compiles.
TINY = """model: {preset: tiny}
sampler: {max_len: 256, max_inflight: 8, kv_pages: 33}
learn: {seq_buckets: [128, 256], max_batch_tokens: 1024, logprob_chunk: 64, lora: {rank: 4}}
mesh: {data: 1, fsdp: 1, tp: 1}
"""


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """The CLI's plans: the float32 tiny config on a 2 GB device (both routes compared), the same config in
    bf16 on a 20 MB device (no comparison). Returns (exit code, figures, stderr, config path) of each."""
    tmp = tmp_path_factory.mktemp("plan")
    out = []
    for name, text, memory, extra in (
            ("f32", TINY, "2GB", []),
            ("bf16", TINY.replace("preset: tiny}", "preset: tiny, dtype: bfloat16}"), "20MB",
             ["--no-compare"])):
        cfg, fig = tmp / f"{name}.yaml", tmp / f"{name}.json"
        cfg.write_text(text)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli(["plan", "--config", str(cfg), "--device-memory", memory, *extra, "--json", str(fig)])
        out.append((code, json.loads(fig.read_text()), err.getvalue(), cfg))
    return out


def test_plan_figures_and_a_plan_that_does_not_fit(plans):
    (code, fig, _, _), (small_code, small, err, _) = plans
    assert code == 0
    assert all(k in fig for k in KEYS) and fig["plan.fits"] is True
    assert fig["plan.route"] == "lora" and fig["plan.remat"] is False  # auto: fits without remat
    assert fig["plan.remat_on.act_gb"] < fig["plan.no_remat.act_gb"]
    assert fig["plan.trainable_gb"] < fig["plan.full.grads_gb"]
    assert fig["plan.opt_gb"] < fig["plan.full.opt_gb"]
    assert 0 < fig["plan.total_gb"] <= 2 and fig["plan.max_inflight_fit"] >= 8
    # a device too small for the update: exit 1 and say what does not fit
    assert small_code == 1 and "does not fit: the update needs" in err
    assert small["plan.fits"] is False and small["plan.remat"] is True  # auto: remat on when nothing fits
    assert not any(k.startswith("plan.full.") for k in small)  # --no-compare


def test_sizes_and_remat_settings():
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1GiB") == 2**30 and parse_bytes("24") == 24e9
    assert resolve_remat(load(None, ["learn.remat=true"])) is True
    assert resolve_remat(load(None, ["learn.remat=false"])) is False
    assert resolve_remat(load(None)) is False  # auto: the tiny default fits any host without remat


# The ENTRY computation of a bf16 weight's loop as XLA:CPU of jaxlib 0.10 compiles it: the weight's convert
# to f32 is hoisted out of the loop and carried through it.
_HOISTED_ENTRY = """
ENTRY %main.4 (w.1: bf16[256,256], x.1: bf16[2,256]) -> bf16[2,256] {
  %w.1 = bf16[256,256]{1,0} parameter(0), metadata={op_name="w"}
  %x.1 = bf16[2,256]{1,0} parameter(1), metadata={op_name="x"}
  %wrapped_convert = f32[256,256]{1,0} fusion(%w.1), kind=kLoop, calls=%wrapped_convert_computation
  %copy.6 = bf16[2,256]{1,0} copy(%x.1)
  %tuple.8 = (bf16[2,256]{1,0}, f32[256,256]{1,0}) tuple(%copy.6, %wrapped_convert)
  ROOT %while.1 = (bf16[2,256]{1,0}, f32[256,256]{1,0}) while(%tuple.8), condition=%c, body=%b
}
"""


def test_hoisted_upcasts_counts_f32_copies_of_16_bit_weights():
    """A float32 copy of a whole bf16 parameter made in ENTRY counts its f32 size; an f32 weight needs no
    copy. Compiled here, the count follows what the loop carries: XLA:CPU of jaxlib 0.10 hoists the
    weight's upcast out of the loop, jaxlib 0.12's runs the bf16 dot natively and makes no copy."""
    import jax
    import jax.numpy as jnp

    from retrojax.plan.memory import hoisted_upcasts

    assert hoisted_upcasts(_HOISTED_ENTRY) == 256 * 256 * 4
    assert hoisted_upcasts(_HOISTED_ENTRY.replace("bf16[256,256]", "f32[256,256]")) == 0
    assert hoisted_upcasts(_HOISTED_ENTRY.replace("f32[256,256]", "f32[128,256]")) == 0  # a part
    assert hoisted_upcasts("no entry computation") == 0

    def loop(w, x):
        return jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w).astype(h.dtype), x)

    for dtype in (jnp.bfloat16, jnp.float32):
        w = jax.ShapeDtypeStruct((256, 256), dtype)
        x = jax.ShapeDtypeStruct((2, 256), dtype)
        text = jax.jit(loop).lower(w, x).compile().as_text()
        entry = text[text.find("\nENTRY"):]
        while_line = next(line for line in entry.splitlines() if " while(" in line)
        carried = dtype == jnp.bfloat16 and "f32[256,256]" in while_line
        assert hoisted_upcasts(text) == (256 * 256 * 4 if carried else 0)


def test_bf16_plan_compiles_as_float16_and_counts_the_held_sampler(plans):
    """A bf16 model on XLA:CPU is compiled as float16 (same bytes), and the sampler's KV cache and layer
    copies (kept by the trainer between rollouts) count in the update phase."""
    from retrojax.plan.memory import GB, sampler_held_bytes, shapes_from_config

    _, fig, _, path = plans[1]
    assert fig["plan.compiled_dtype"] == "float16"
    c = load(str(path))
    shapes = shapes_from_config(c)
    held = sampler_held_bytes(c, shapes, None, shapes.lora) / GB
    assert held > 0 and abs(fig["plan.sampler_held_gb"] - held) < 1e-9
    assert abs(fig["plan.kv_gb"] + fig["plan.sampler_weights_gb"] - held) < 1e-9
    assert fig["plan.update_gb"] >= fig["plan.params_gb"] + held
    assert fig["plan.total_gb"] == max(fig["plan.update_gb"], fig["plan.rollout_gb"], fig["plan.logprob_gb"])
