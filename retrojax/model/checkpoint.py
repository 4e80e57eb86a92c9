"""Hugging Face Qwen3 checkpoints in and out: safetensors (single file or sharded index) + config.json.

The safetensors format is read and written here directly (a JSON header + raw little-endian bytes), so bf16
works without torch, every failure names the tensor and file, and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from retrojax.model.qwen3 import Qwen3, Qwen3Config
from retrojax.parallel.rules import TRAIN_RULES
from retrojax.parallel.rules import partition_spec as _partition_spec

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

# Logical axis name -> mesh axis (retrojax.parallel.rules' train profile). Axes absent from the mesh, or not
# dividing the dim, stay replicated.
DEFAULT_RULES = TRAIN_RULES


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as this Qwen3 (message names the file and tensor)."""


# ---- safetensors ------------------------------------------------------------------------------------
def _read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path} is truncated or not safetensors: header claims {n} bytes, "
                                  f"file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not an object)")
    header.pop("__metadata__", None)
    return header, 8 + n, size


class _SafetensorsFile:
    """Memory-mapped read access to one .safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        self.header, self.data_start, size = _read_header(path)
        for name, info in self.header.items():
            try:
                begin, end = info["data_offsets"]
                dtype = _ST_DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
            except KeyError as e:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported/missing header field {e}"
                                      ) from e
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CheckpointError(f"{path}: tensor {name!r} byte range does not match shape {shape}")
            if self.data_start + end > size:
                raise CheckpointError(f"{path} is truncated: tensor {name!r} needs bytes up to "
                                      f"{self.data_start + end}, file has {size}")
        self._file = path.open("rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]]
        buf = np.frombuffer(self._map, dtype=np.uint8, count=end - begin, offset=self.data_start + begin)
        return buf.view(dtype).reshape(info["shape"])

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """A copy of ``tensor[index]`` that touches only the mapped pages holding that block."""
        return np.array(self.get(name)[index])

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        self._file.close()


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write numpy arrays (f32/f16/bf16/...) as a safetensors file transformers can read."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        dt = np.dtype(arr.dtype).newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
        if np.dtype(arr.dtype) not in _ST_NAMES and dt not in _ST_NAMES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {arr.dtype}")
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[np.dtype(arr.dtype)], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


class _Checkpoint:
    """Name -> tensor access over a single-file or index-sharded safetensors checkpoint."""

    def __init__(self, path: Path):
        single, index = path / "model.safetensors", path / "model.safetensors.index.json"
        self.files: dict[str, _SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index (needs 'weight_map')") from e
            for shard in sorted(set(weight_map.values())):
                if not (path / shard).exists():
                    raise CheckpointError(f"{index} names shard {shard!r}, which is missing from {path}")
                self.files[shard] = _SafetensorsFile(path / shard)
            for name, shard in weight_map.items():
                if name not in self.files[shard].header:
                    raise CheckpointError(f"{index} maps tensor {name!r} to {shard}, which lacks it")
                self.where[name] = shard
        elif single.exists():
            self.files["model.safetensors"] = _SafetensorsFile(single)
            self.where = {name: "model.safetensors" for name in self.files["model.safetensors"].header}
        else:
            found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
            pickles = [n for n in found if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
            hint = (f" (found {pickles}; pickled weights are never loaded, convert to safetensors)"
                    if pickles else "")
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.where[name]].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].get(name)

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.files[self.where[name]].get_slice(name, index)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


# ---- name mapping -----------------------------------------------------------------------------------
_LAYER_HF = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def _hf_layer_shape(name: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The torch (out, in) shape of one layer's tensor, given our stacked shape without the layer axis."""
    if name.endswith("norm"):
        return ours
    if name in ("q", "k", "v"):  # ours [H, heads, D]
        return (ours[1] * ours[2], ours[0])
    if name == "o":  # ours [N, D, H]
        return (ours[2], ours[0] * ours[1])
    return (ours[1], ours[0])  # gate/up [H, I] -> [I, H]; down [I, H] -> [H, I]


def _to_ours(name: str, w: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm"):
        return w
    return w.T.reshape(ours)


def _to_hf(name: str, w: np.ndarray) -> np.ndarray:
    if name.endswith("norm"):
        return w
    if name in ("q", "k", "v"):  # [H, heads, D] -> [heads * D, H]
        return w.reshape(w.shape[0], -1).T
    return w.reshape(-1, w.shape[-1]).T  # o: [N, D, H] -> [H, N * D]; 2-D: transpose


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Device index slices (start/stop may be None) as explicit unit-step slices over ``shape``."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise CheckpointError(f"sharded load needs unit-step shard slices, got {sl}")
        out.append(slice(start, stop))
    return tuple(out)


def _read_ours_block(ckpt: _Checkpoint, hf: str, name: str, block: tuple[slice, ...],
                     ours: tuple[int, ...]) -> np.ndarray:
    """``_to_ours(name, tensor hf)[block]``, reading only the source rows/columns that block needs.

    ``ours`` is our (per-layer) shape; ``block`` unit-step slices over it. Transposed weights slice the source
    on the swapped axes; q/k/v/o read the whole-head row/column range covering the block's heads.
    """
    if name.endswith("norm") or name in ("embed", "final_norm", "lm_head"):
        return ckpt.get_slice(hf, block)
    if name in ("q", "k", "v"):  # ours [H, heads, D] = w[heads * D, H].T
        sh, sn, sd = block
        d = ours[2]
        w = ckpt.get_slice(hf, (slice(sn.start * d, sn.stop * d), sh))
        return w.T.reshape(sh.stop - sh.start, sn.stop - sn.start, d)[:, :, sd]
    if name == "o":  # ours [N, D, H] = w[H, N * D].T
        sn, sd, sh = block
        d = ours[1]
        w = ckpt.get_slice(hf, (sh, slice(sn.start * d, sn.stop * d)))
        return w.T.reshape(sn.stop - sn.start, d, sh.stop - sh.start)[:, sd, :]
    a, b = block  # gate/up/down: ours = w.T
    return ckpt.get_slice(hf, (b, a)).T


def _load_sharded(ckpt: _Checkpoint, hf_names: list[str], name: str, shape: tuple[int, ...],
                  sharding: NamedSharding, np_dtype: np.dtype) -> jax.Array:
    """One parameter as a global array, built from this process's addressable shards only.

    ``hf_names`` is [the tensor] for a top-level param or one tensor per layer for a stacked layer param
    (axis 0 = layer). Replicas of a block are read once.
    """
    layered = name in _LAYER_HF
    blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        block = _bounds(index, shape)
        key = tuple((sl.start, sl.stop) for sl in block)
        if key not in blocks:
            if layered:
                parts = [_read_ours_block(ckpt, hf_names[i], name, block[1:], shape[1:])
                         for i in range(block[0].start, block[0].stop)]
                local = np.stack(parts) if parts else np.empty(
                    (0, *(sl.stop - sl.start for sl in block[1:])))
            else:
                local = _read_ours_block(ckpt, hf_names[0], name, block, shape)
            blocks[key] = np.ascontiguousarray(local.astype(np_dtype))
        arrays.append(jax.device_put(blocks[key], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _expected(config: Qwen3Config, model: Qwen3) -> Iterator[tuple[str, str, int | None, tuple[int, ...]]]:
    """(hf name, our param name, layer or None, torch shape) for every tensor the model needs."""
    c = config
    yield "model.embed_tokens.weight", "embed", None, (c.vocab_size, c.hidden_size)
    yield "model.norm.weight", "final_norm", None, (c.hidden_size,)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", "lm_head", None, (c.vocab_size, c.hidden_size)
    for name, hf in _LAYER_HF.items():
        ours = tuple(getattr(model.layers, name).shape[1:])
        for i in range(c.num_hidden_layers):
            yield f"model.layers.{i}.{hf}", name, i, _hf_layer_shape(name, ours)


# ---- sharding ---------------------------------------------------------------------------------------
def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
                   rules: Mapping[str, Any] = DEFAULT_RULES) -> PartitionSpec:
    """Map logical axis names onto mesh axes; a mesh axis is used once and only where it divides the dim."""
    return _partition_spec(axes, shape, mesh, rules)


def param_shardings(model: Qwen3, mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES) -> nnx.State:
    """A State of NamedShardings mirroring the model's parameters (from their logical axis names)."""
    state = nnx.state(model, nnx.Param)

    def one(var: nnx.Variable) -> NamedSharding:
        axes = var.get_metadata()["out_sharding"]
        return NamedSharding(mesh, partition_spec(tuple(axes), tuple(var[...].shape), mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: Qwen3, mesh: Mesh, rules: Mapping[str, Any] = DEFAULT_RULES) -> Qwen3:
    """Place every parameter of ``model`` (in place) with its NamedSharding on ``mesh``; returns the model."""
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            axes = tuple(var.get_metadata()["out_sharding"])
            value = var[...]
            spec = partition_spec(axes, tuple(value.shape), mesh, rules)
            var.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
    return model


# ---- public API -------------------------------------------------------------------------------------
def from_pretrained(path: str | Path, dtype: Any = jnp.float32, mesh: Mesh | None = None,
                    rules: Mapping[str, Any] = DEFAULT_RULES) -> Qwen3:
    """Load a Hugging Face Qwen3 checkpoint directory (config.json + safetensors) as a ``Qwen3``.

    With ``mesh``, each parameter is placed with the NamedSharding its logical axis names map to under
    ``rules``, and each process reads only the blocks of each tensor its addressable devices hold (never a
    sharded tensor whole). Missing/unexpected tensors and shape mismatches raise CheckpointError naming the
    tensor.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = Qwen3Config.from_json(path / "config.json")
    dtype = jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: Qwen3(config, dtype=dtype))
    ckpt = _Checkpoint(path)
    try:
        expected = list(_expected(config, model))
        names = ckpt.names()
        missing = [hf for hf, *_ in expected if hf not in names]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint {path} lacks tensor(s): {', '.join(missing[:5])}{more}")
        allowed = {hf for hf, *_ in expected} | ({"lm_head.weight"} if config.tie_word_embeddings else set())
        unexpected = sorted(names - allowed)
        if unexpected:
            raise CheckpointError(f"checkpoint {path} has unexpected tensor(s) for this config: "
                                  f"{', '.join(unexpected[:5])}")
        for hf, _, _, shape in expected:
            if ckpt.shape(hf) != shape:
                raise CheckpointError(f"tensor {hf!r} in {path} has shape {ckpt.shape(hf)}, "
                                      f"config implies {shape}")

        np_dtype = np.dtype(dtype)
        if mesh is not None:
            # each process reads only the blocks its addressable devices hold (multi-host ready)
            sources: dict[str, list[str]] = {}
            for hf, name, _, _ in expected:
                sources.setdefault(name, []).append(hf)
            for name, hf_names in sources.items():
                var = getattr(model.layers if name in _LAYER_HF else model, name)
                shape = tuple(var.shape)
                axes = tuple(var.get_metadata()["out_sharding"])
                sharding = NamedSharding(mesh, partition_spec(axes, shape, mesh, rules))
                var.set_value(_load_sharded(ckpt, hf_names, name, shape, sharding, np_dtype))
            return model
        host: dict[str, np.ndarray] = {}
        for hf, name, layer, _ in expected:
            target = getattr(model.layers if layer is not None else model, name)
            if layer is None:
                host[name] = np.asarray(ckpt.get(hf)).astype(np_dtype)
                continue
            if name not in host:
                host[name] = np.empty(target.shape, np_dtype)
            host[name][layer] = _to_ours(name, ckpt.get(hf), tuple(target.shape[1:])).astype(np_dtype)
    finally:
        ckpt.close()

    for name, arr in host.items():
        getattr(model.layers if name in _LAYER_HF else model, name).set_value(jnp.asarray(arr))
    return model


def save_pretrained(model: Qwen3, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``model`` as a transformers-loadable checkpoint (config.json + safetensors, sharded if large)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors: dict[str, np.ndarray] = {}
    tensors["model.embed_tokens.weight"] = np.asarray(jax.device_get(model.embed[...]))
    for name, hf in _LAYER_HF.items():
        stacked = np.asarray(jax.device_get(getattr(model.layers, name)[...]))
        for i in range(config.num_hidden_layers):
            tensors[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(_to_hf(name, stacked[i]))
    tensors["model.norm.weight"] = np.asarray(jax.device_get(model.final_norm[...]))
    if model.lm_head is not None:
        tensors["lm_head.weight"] = np.asarray(jax.device_get(model.lm_head[...]))

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(path / fname, shard)
            weight_map.update({name: fname for name in shard})
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = config.to_hf_dict(model.dtype)
    cfg["dtype"] = cfg["torch_dtype"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
