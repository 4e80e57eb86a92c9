"""The closed-form bound: what a run keeps on the device, from shapes and dtypes alone (nothing compiled).

Parameter counts, KV bytes per row or per page, the trainer's and a decoder's resident parts, and the device
share the bound may fill. The admission check (:mod:`retrojax.plan.admission`) decides with these first; the
compile-only plan (:mod:`retrojax.plan.memory`) sizes a paged cache's pool with the same terms, so both read
them from here (a module below both).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

GB = 1e9


# Share of the device the closed-form bound may fill: XLA's own workspace, fragmentation, the host's other
# processes on CPU. The compile-only plan replaces the bound where it is tight.
USABLE = 0.85

_UNITS = {"": 1e9, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> float:
    """``80GB`` / ``80`` (GB) / ``141GiB`` / ``16e9B`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--device-memory {text!r}: expected a size such as 80GB, 141GiB or 24")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"--device-memory must be > 0, got {text!r}")
    return value


def model_shape(cfg: Any) -> Any:
    """The Qwen3Config of ``cfg.model``: a checkpoint's config.json (no weights read) or the preset."""
    from retrojax.model.qwen3 import PRESETS, Qwen3Config

    if cfg.model.path:
        return Qwen3Config.from_json(cfg.model.path)
    if cfg.model.preset not in PRESETS:
        raise ValueError(f"model.preset {cfg.model.preset!r} is not one of {sorted(PRESETS)}")
    return PRESETS[cfg.model.preset]


def lora_settings(cfg: Any) -> Any:
    """The LoRA the run trains (learn.lora with rank > 0, or the rank of ``model.adapter``), else None."""
    lora = getattr(cfg.learn, "lora", None)
    adapter = getattr(cfg.model, "adapter", None)
    if adapter:
        from retrojax.model.peft import read_adapter_config

        a = read_adapter_config(adapter)
        targets = [t for t in ("q", "k", "v", "o", "gate", "up", "down")
                   if f"{t}_proj" in (a.get("target_modules") or [])] or list(lora.targets)
        return dataclasses.replace(lora, rank=int(a["r"]), alpha=float(a["lora_alpha"]),
                                   targets=tuple(targets))
    return lora if lora is not None and lora.rank > 0 else None


def param_count(config: Any) -> int:
    """Parameters of a Qwen3 config (embeddings, attention with q/k norms, SwiGLU MLP, norms, LM head)."""
    h, d, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 2 * d
    mlp = 3 * h * config.intermediate_size
    per_layer = attn + mlp + 2 * h
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return config.vocab_size * h + head + h + layers * per_layer


def layer_param_count(config: Any) -> int:
    """Parameters of the stacked decoder layers (what the sampler copies per layer for decoding)."""
    return param_count(config) - config.vocab_size * config.hidden_size * (
        1 if config.tie_word_embeddings else 2) - config.hidden_size


def kv_bytes_per_row(config: Any, max_len: int, dtype: str) -> int:
    """Keys and values of one dense cache row of ``max_len`` slots."""
    import numpy as np

    size = np.dtype(dtype).itemsize
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * max_len * size


def decode_bytes_per_row(config: Any) -> int:
    """A generous bound on one row's decode temporaries: float32 logits and their softmax/sort buffers."""
    return 6 * config.vocab_size * 4 + 64 * config.hidden_size * 4


def lora_param_count(config: Any, lora: Any) -> int:
    """Adapter parameters (A and B per targeted projection and layer)."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"q": (h, config.num_attention_heads * d), "k": (h, config.num_key_value_heads * d),
              "v": (h, config.num_key_value_heads * d), "o": (config.num_attention_heads * d, h),
              "gate": (h, inter), "up": (h, inter), "down": (inter, h)}
    per_layer = sum(lora.rank * (a + b) for t, (a, b) in shapes.items() if t in lora.targets)
    return config.num_hidden_layers * per_layer


def itemsize(dtype: str) -> int:
    import numpy as np

    return int(np.dtype(dtype).itemsize)


def train_resident_bytes(cfg: Any, remat: bool = False) -> dict[str, float]:
    """Closed-form bytes a trainer keeps besides the sampler's rows (one device, no mesh), by part; ``remat``:
    the update keeps only each layer's input (and one layer's activations) for the backward pass."""
    c = model_shape(cfg)
    it = itemsize(cfg.model.dtype)
    lora = lora_settings(cfg)
    n = param_count(c)
    trainable = n if lora is None else lora_param_count(c, lora)
    train_it = it if lora is None else itemsize(lora.dtype)
    master_it = 4 if cfg.learn.master_dtype == "float32" else train_it
    master_it = max(master_it, train_it)
    parts = {
        "weights": float(n * it + (0 if lora is None else trainable * train_it)),
        "masters": float(trainable * master_it if master_it != train_it else 0),
        "adamw": float(2 * trainable * master_it),
        "grads": float(trainable * master_it),
        "reference": float(trainable * train_it if cfg.learn.kl_coef > 0 or cfg.learn.track_kl_ref else 0),
        "layer_copies": float(layer_param_count(c) * it if layer_copies_kept(cfg) else 0),
    }
    # update activations: every layer's activations of one microbatch in float32 (remat: one layer's, plus
    # each layer's input), plus the chunked LM head's logits (three float32 copies: logits, softmax, gradient)
    fitting = [b for b in cfg.learn.seq_buckets if b <= cfg.sampler.max_len]
    length = max(fitting) if fitting else min(cfg.learn.seq_buckets)
    rows = max(1, cfg.learn.max_batch_tokens // length)
    per_token = 16 * c.hidden_size + 8 * c.intermediate_size + 8 * c.num_attention_heads * c.head_dim
    tokens = rows * length
    # attention scores, probabilities and their gradient in float32 as if unblocked ([rows, heads, L, L]):
    # an over-count where attention is computed in blocks, so that the bound stays a bound on every layout
    scores = 3 * rows * c.num_attention_heads * length * length * 4
    acts = (tokens * per_token * 4 + scores + c.num_hidden_layers * tokens * c.hidden_size * 4 if remat
            else c.num_hidden_layers * (tokens * per_token * 4 + scores))
    logits = rows * min(length, cfg.learn.logprob_chunk) * c.vocab_size * 4 * 3
    parts["activations"] = float(acts + logits)
    return parts


def inference_resident_bytes(config: Any, dtype: str, layer_copies: bool | str = "auto") -> dict[str, float]:
    """Closed-form bytes a decoding-only run keeps besides its rows: the weights and the sampler's per-layer
    copies (``layer_copies``: ``sampler.layer_copies``; none where the decode scans the stacked weights)."""
    from retrojax.model.qwen3 import use_layer_copies

    it = itemsize(dtype)
    copies = layer_param_count(config) * it if use_layer_copies(layer_copies) else 0
    return {"weights": float(param_count(config) * it), "layer_copies": float(copies)}


def layer_copies_kept(cfg: Any) -> bool:
    """Whether the run's samplers keep per-layer weight copies (``sampler.layer_copies`` on this backend)."""
    from retrojax.model.qwen3 import use_layer_copies

    return use_layer_copies(getattr(cfg.sampler, "layer_copies", "auto"))


@dataclasses.dataclass(frozen=True)
class KVShape:
    """How the sampler keeps keys and values, for the plan: dense rows of ``max_len`` slots, or a pool of
    pages."""

    config: Any
    max_len: int
    dtype: str
    paged: bool

    @classmethod
    def of(cls, cfg: Any, config: Any = None) -> KVShape:
        return cls(config if config is not None else model_shape(cfg), cfg.sampler.max_len, cfg.model.dtype,
                   getattr(cfg.sampler, "kv", "dense") == "paged")

    @property
    def row_bytes(self) -> int:
        """A dense row; for pages, the pool's floor: one whole row plus a spare page."""
        return kv_bytes_per_row(self.config, self.max_len, self.dtype)

    def page_bytes(self) -> int:
        from retrojax.sampling.pages import PAGE_SIZE, kv_bytes_per_page

        return kv_bytes_per_page(self.config, PAGE_SIZE, itemsize(self.dtype))

    def row_pages(self) -> int:
        from retrojax.sampling.pages import PAGE_SIZE, pages_for

        return pages_for(self.max_len, PAGE_SIZE)

    def split(self, resident: dict[str, float]) -> tuple[dict[str, float], float]:
        """(resident parts, bytes per row): a paged cache holds one whole row of pages whatever the row count
        (its floor) and each row costs only its decode temporaries; a dense row costs its ``max_len``
        slots."""
        per_row = float(decode_bytes_per_row(self.config))
        if not self.paged:
            return resident, per_row + self.row_bytes
        return {**resident, "kv_pool_floor": float((self.row_pages() + 1) * self.page_bytes())}, per_row

    def pool(self, budget: float, resident: dict[str, float], rows: int) -> int | None:
        """Pages of the pool: what is left of the usable device after the resident parts and ``rows`` rows'
        temporaries, at most every row at ``max_len`` (None for a dense cache)."""
        if not self.paged:
            return None
        left = USABLE * budget - sum(v for k, v in resident.items() if k != "kv_pool_floor") \
            - rows * decode_bytes_per_row(self.config)
        most = rows * self.row_pages() + 1
        return int(max(self.row_pages() + 1, min(most, left // self.page_bytes())))
