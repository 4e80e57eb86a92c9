"""from_pretrained on a (2,2,2) mesh of 8 simulated devices reads only the blocks each device holds.

The sharded load must equal the one-device load exactly (every shard at its index), follow the train plan's
shardings, never read a whole tensor (``_Checkpoint.get``), and read each sharded tensor only in strict
sub-blocks, once per distinct block (replicas over ``data`` share one read).
"""

from __future__ import annotations

from hf_fixtures import make_tiny_hf_checkpoint

from retrojax.model.checkpoint import _LAYER_HF
from retrojax.parallel.testing import run_processes, run_snippet

_SNIPPET = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from retrojax.model import checkpoint as ck
from retrojax.parallel.mesh import make_mesh

path = sys.argv[1]
plain = ck.from_pretrained(path)  # one device, whole-tensor reads
plain_bf16 = ck.from_pretrained(path, dtype=jnp.bfloat16)

reads = []
def whole(self, name):
    raise AssertionError(f"whole-tensor read of {name} in a sharded load")
orig = ck._Checkpoint.get_slice
def sliced(self, name, index):
    out = orig(self, name, index)
    reads.append((name, list(out.shape), list(self.shape(name))))
    return out
ck._Checkpoint.get = whole
ck._Checkpoint.get_slice = sliced

mesh = make_mesh(data=2, fsdp=2, tp=2)
model = ck.from_pretrained(path, mesh=mesh)
want = ck.param_shardings(plain, mesh)

mismatch, specs = [], {}
flat_plain = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
flat_model = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
flat_want = dict(nnx.to_flat_state(want))
for key, var in flat_model.items():
    arr, ref = var[...], np.asarray(flat_plain[key][...])
    name = ".".join(map(str, key))
    specs[name] = [None if a is None else str(a) for a in arr.sharding.spec]
    if arr.sharding.spec != flat_want[key].spec or not np.array_equal(np.asarray(arr), ref):
        mismatch.append(name)
    for shard in arr.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), ref[shard.index]):
            mismatch.append(f"{name} shard on {shard.device}")
    blocks = {tuple((s.start, s.stop) for s in ck._bounds(i, arr.shape))
              for i in arr.sharding.addressable_devices_indices_map(arr.shape).values()}
    specs[name].append(len(blocks))
train_reads = list(reads)

# another plan: head_dim split over tp (q/k/v/o sliced inside a head), mlp over fsdp x tp, bf16
rules = {**ck.DEFAULT_RULES, "embed": None, "heads": "fsdp", "kv_heads": "fsdp", "head_dim": "tp",
         "mlp": ("fsdp", "tp")}
other = ck.from_pretrained(path, dtype=jnp.bfloat16, mesh=mesh, rules=rules)
flat_ref = dict(nnx.to_flat_state(nnx.state(plain_bf16, nnx.Param)))
other_specs = {}
for key, var in dict(nnx.to_flat_state(nnx.state(other, nnx.Param))).items():
    arr, ref = var[...], np.asarray(flat_ref[key][...])
    name = ".".join(map(str, key))
    other_specs[name] = [None if a is None else str(a) for a in arr.sharding.spec]
    if arr.dtype != jnp.bfloat16 or not np.array_equal(np.asarray(arr), ref):
        mismatch.append("bf16 " + name)
    for shard in arr.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), ref[shard.index]):
            mismatch.append(f"bf16 {name} shard on {shard.device}")
print(json.dumps({"mismatch": mismatch, "specs": specs, "reads": train_reads, "other_specs": other_specs,
                  "devices": jax.device_count()}))
"""


def test_sharded_load_reads_only_device_blocks(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path, num_key_value_heads=2, tie_word_embeddings=False,
                                   max_shard_size="60KB")
    out = run_snippet(_SNIPPET, devices=8, timeout=300, args=[str(path)])
    assert out["devices"] == 8
    assert out["mismatch"] == []
    specs = out["specs"]
    assert specs["embed"][:2] == ["tp", "fsdp"] and specs["embed"][2] == 4
    assert specs["layers.q"][:4] == [None, "fsdp", "tp", None]
    assert specs["layers.o"][:4] == [None, "tp", None, "fsdp"]
    other = out["other_specs"]
    assert other["layers.q"] == [None, None, "fsdp", "tp"] and other["layers.o"] == [None, "fsdp", "tp", None]
    assert other["layers.gate"] == [None, None, "('fsdp', 'tp')"]

    per_tensor: dict[str, list[tuple[list[int], list[int]]]] = {}
    for name, got, full in out["reads"]:
        per_tensor.setdefault(name, []).append((got, full))
    assert len(per_tensor) == 3 + 2 * 11  # embed, final norm, lm_head + 11 tensors per layer
    ours = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head",
            "model.norm.weight": "final_norm"}
    ours.update({f"model.layers.{i}.{hf}": f"layers.{name}"
                 for name, hf in _LAYER_HF.items() for i in range(2)})
    for tensor, rs in per_tensor.items():
        spec = specs[ours[tensor]]
        sharded = any(a is not None for a in spec[:-1])
        assert len(rs) == spec[-1], (tensor, len(rs), spec)  # one read per distinct block
        for got, full in rs:
            size, whole = _prod(got), _prod(full)
            if sharded:
                assert size < whole, (tensor, got, full)
            else:
                assert got == full, (tensor, got, full)
    # q (fsdp x tp over [H, heads, D]) reads a quarter of the source tensor per block
    q_reads = per_tensor["model.layers.0.self_attn.q_proj.weight"]
    assert all(_prod(g) * 4 == _prod(f) for g, f in q_reads)


def _prod(shape: list[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


_TWO_PROCESSES = """
import json, os, sys
import jax, numpy as np
from flax import nnx
from retrojax.config import from_dict
from retrojax.parallel.distributed import setup
setup(from_dict({"distributed": {"initialize": "on", "coordinator": os.environ["RETROJAX_COORDINATOR"],
                                 "num_processes": 2, "process_id": int(os.environ["RETROJAX_PROCESS_ID"]),
                                 "compile_cache": False}}))
from retrojax.model import checkpoint as ck
from retrojax.parallel.mesh import make_mesh

path = PATH
plain = ck.from_pretrained(path)
reads = {}
orig = ck._Checkpoint.get_slice
def sliced(self, name, index):
    out = orig(self, name, index)
    reads.setdefault(name, [0, int(np.prod(self.shape(name)))])[0] += out.size
    return out
ck._Checkpoint.get_slice = sliced
model = ck.from_pretrained(path, mesh=make_mesh(data=1, fsdp=4, tp=2))
flat_plain = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
bad = []
for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    arr, ref = var[...], np.asarray(flat_plain[key][...])
    if arr.is_fully_addressable and any(a is not None for a in arr.sharding.spec):
        bad.append(f"{key} is not global")
    for shard in arr.addressable_shards:
        if not np.array_equal(np.asarray(shard.data), ref[shard.index]):
            bad.append(f"{key} shard {shard.index}")
print(json.dumps({"pid": jax.process_index(), "bad": bad, "reads": reads}))
"""


def test_each_process_reads_only_its_half(tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path, num_key_value_heads=2, tie_word_embeddings=False)
    results = run_processes(_TWO_PROCESSES.replace("PATH", repr(str(path))), processes=2,
                            devices_per_process=4, timeout=300)
    assert [r["pid"] for r in results] == [0, 1]
    for r in results:
        assert r["bad"] == []
        assert len(r["reads"]) == 3 + 2 * 11
        for name, (got, whole) in r["reads"].items():
            # (1, 4, 2) mesh: every weight is split 8 ways, 4 blocks per process; norms are replicated
            assert got == (whole if name.endswith("norm.weight") else whole // 2), (name, got, whole)
