"""PEFT LoRA adapter directories in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

Tensor names are PEFT's (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``, torch
``[r, in]``; ``lora_B.weight``: ``[out, r]``), so transformers + ``peft.PeftModel.from_pretrained`` load what
we write and we load what PEFT writes. PEFT's scaling is ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), the
same ``scale`` our layers hold; we write ``lora_alpha = scale · r`` so the scaling is identical whatever the
adapter came from. Features without a counterpart here (DoRA, bias adapters, per-module ranks, extra trained
modules, adapters outside the decoder's seven projections) are refused with an error that names them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from retrojax.model.lora import HF_MODULES, TARGETS, adapter_shapes, adapter_values, apply_lora, is_lora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\."
                  r"lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


class AdapterError(ValueError):
    """A PEFT adapter directory that cannot be used with this model (the message says why)."""


def _key(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{HF_MODULES[target]}.lora_{which}.weight"


def save_peft_adapter(model: Any, path: str | Path, base: str | None = None) -> Path:
    """Write the adapters of a LoRA ``model`` as a PEFT adapter directory; ``base`` names the base model
    (``base_model_name_or_path``: the checkpoint directory or preset the adapters were trained on)."""
    if not is_lora(model):
        raise ValueError("save_peft_adapter needs a model with LoRA adapters")
    from retrojax.model.checkpoint import write_safetensors

    layers = model.layers
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for t, (a, b) in adapter_values(model).items():
        a = np.asarray(jax.device_get(a))
        b = np.asarray(jax.device_get(b))
        n, r = a.shape[0], a.shape[-1]
        a = a.reshape(n, -1, r)  # [L, in, r]
        b = b.reshape(n, r, -1)  # [L, r, out]
        for i in range(n):
            tensors[_key(i, t, "A")] = np.ascontiguousarray(a[i].T)
            tensors[_key(i, t, "B")] = np.ascontiguousarray(b[i].T)
    write_safetensors(path / WEIGHTS_FILE, tensors)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": layers.rank,
        "lora_alpha": layers.scale * layers.rank,
        "lora_dropout": layers.dropout,
        "target_modules": [HF_MODULES[t].split(".")[-1] for t in layers.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The adapter's config, checked for what we can apply."""
    path = Path(path)
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory (no {CONFIG_FILE})")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{file} must hold a JSON object")
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {cfg.get('peft_type')!r} (only LORA)")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        problems.append(f"r must be a positive int, got {cfg.get('r')!r}")
    if not isinstance(cfg.get("lora_alpha"), (int, float)) or cfg["lora_alpha"] <= 0:
        problems.append(f"lora_alpha must be > 0, got {cfg.get('lora_alpha')!r}")
    if cfg.get("use_dora"):
        problems.append("use_dora (DoRA) is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        problems.append("bias adapters are not supported (bias must be 'none')")
    if cfg.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out=true is for Conv1D layers; Qwen3 has Linear layers")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg['modules_to_save']} (fully trained extra modules) "
                        "is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            problems.append(f"{key} (per-module ranks/alphas) is not supported")
    if problems:
        raise AdapterError(f"{file}: " + "; ".join(problems))
    return cfg


def load_peft_adapter(model: Any, path: str | Path, dtype: Any = jnp.float32) -> Any:
    """Put the PEFT adapter at ``path`` onto ``model`` (a plain Qwen3; in place, also returned).

    Layers the adapter leaves out (``layers_to_transform``) get zero adapters.
    """
    from retrojax.model.checkpoint import _SafetensorsFile

    path = Path(path)
    cfg = read_adapter_config(path)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        other = " (adapter_model.bin is a pickle; we read safetensors only)" if (
            path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}{other}")
    rank = int(cfg["r"])
    c = model.config
    found: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    st = _SafetensorsFile(file)
    try:
        for name in st.header:
            m = _KEY.match(name)
            target = m.group(3) if m else None
            if target not in TARGETS:
                raise AdapterError(f"{file}: tensor {name!r} is not an adapter of a Qwen3 decoder "
                                   f"projection ({', '.join(HF_MODULES.values())})")
            layer = int(m.group(1))
            if layer >= c.num_hidden_layers:
                raise AdapterError(f"{file}: tensor {name!r} is for layer {layer}; the model has "
                                   f"{c.num_hidden_layers}")
            found.setdefault((target, m.group(4)), {})[layer] = np.array(st.get(name))
    finally:
        st.close()
    targets = [t for t in TARGETS if (t, "A") in found or (t, "B") in found]
    if not targets:
        raise AdapterError(f"{file} holds no LoRA tensors")
    adapters = {}
    for t in targets:
        a_shape, b_shape = adapter_shapes(tuple(getattr(model.layers, t).shape), t, rank)
        fan_in, fan_out = math.prod(a_shape[1:-1]), math.prod(b_shape[2:])
        a = np.zeros((c.num_hidden_layers, fan_in, rank), np.float32)
        b = np.zeros((c.num_hidden_layers, rank, fan_out), np.float32)
        layers_a, layers_b = found.get((t, "A"), {}), found.get((t, "B"), {})
        if set(layers_a) != set(layers_b):
            raise AdapterError(f"{file}: {HF_MODULES[t]} has lora_A in layers {sorted(layers_a)} but lora_B "
                               f"in {sorted(layers_b)}")
        for i in layers_a:
            wa, wb = layers_a[i], layers_b[i]
            if wa.shape != (rank, fan_in) or wb.shape != (fan_out, rank):
                raise AdapterError(f"{file}: layer {i} {HF_MODULES[t]} has lora_A {wa.shape}, lora_B "
                                   f"{wb.shape}; r={rank} on this model needs {(rank, fan_in)}, "
                                   f"{(fan_out, rank)}")
            a[i], b[i] = wa.astype(np.float32).T, wb.astype(np.float32).T
        adapters[t] = (a.reshape(a_shape), b.reshape(b_shape))
    alpha = float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    dropout = float(cfg.get("lora_dropout") or 0.0)
    return apply_lora(model, rank=rank, alpha=alpha, targets=targets, dropout=dropout, dtype=dtype,
                      adapters=adapters, scale=scale)


def save_policy(model: Any, path: str | Path, *, base: str | None = None, merged: bool = False) -> Path:
    """``save_pretrained`` of a policy: a LoRA model writes a PEFT adapter directory at ``path`` (and, with
    ``merged``, full merged weights in ``path/merged``); a plain model writes its full checkpoint."""
    from retrojax.model.checkpoint import save_pretrained
    from retrojax.model.lora import merge_lora

    if not is_lora(model):
        return save_pretrained(model, path)
    out = save_peft_adapter(model, path, base=base)
    if merged:
        save_pretrained(merge_lora(model), Path(path) / "merged")
    return out
