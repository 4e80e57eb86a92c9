"""Qwen3 decoder in Flax nnx, numerically matching transformers' ``Qwen3ForCausalLM``.

Layers are stacked on a leading axis and run with ``lax.scan`` so compile time does not grow with depth;
decode loops on CPU instead unroll them over per-layer weight slices taken once (``layer_weights``; see
``hidden_cached`` and ``use_layer_copies``). Attention is the einsum blocks of ``attend``/``attend_tree``, the
Pallas kernels (forest attention, paged attention) or ``jax.nn.dot_product_attention``, as ``model.attention``
says (``attention_kind``). Every parameter carries logical axis names (``out_sharding`` metadata) so a
checkpoint can be placed on a mesh. Norms, softmax and logits are computed in float32 whatever the parameter
dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from retrojax.parallel.rules import constrain

_NEG = -1e30  # finite "minus infinity": fully masked rows stay finite (uniform) instead of NaN


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """The fields of a Qwen3 ``config.json`` that change the math (others are ignored or rejected)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40_960
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, "
                             f"{self.rope_theta}")

    @property
    def num_groups(self) -> int:
        """Query heads per kv head: query head n reads kv head n // num_groups."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3Config:
        """Build from a transformers config dict (4.x top-level ``rope_theta`` or 5.x ``rope_parameters``).

        Features we do not implement (sliding window, rope scaling, attention bias, other activations) are
        refused with a ValueError rather than silently computing something different.
        """
        d = dict(d)
        model_type = d.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ValueError(f"config model_type is {model_type!r}; only 'qwen3' is supported")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config lacks required field(s): {', '.join(missing)}")
        if d.get("use_sliding_window"):
            raise ValueError("config enables sliding-window attention (use_sliding_window=true); "
                             "not supported")
        layer_types = d.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config layer_types {sorted(set(layer_types))} include non-full attention; "
                             "sliding-window attention is not supported")
        if d.get("attention_bias"):
            raise ValueError("config sets attention_bias=true; Qwen3 here has no attention bias")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config hidden_act is {act!r}; only 'silu' is supported")
        rope_theta = d.get("rope_theta")
        for key in ("rope_parameters", "rope_scaling"):
            rope = d.get(key)
            if rope is None:
                continue
            if not isinstance(rope, Mapping):
                raise ValueError(f"config {key} must be a mapping, got {rope!r}")
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in (None, "default"):
                raise ValueError(f"config {key} asks for rope_type {rope_type!r}; "
                                 "only 'default' is supported")
            if "rope_theta" in rope:
                if rope_theta is not None and float(rope["rope_theta"]) != float(rope_theta):
                    raise ValueError(f"config rope_theta {rope_theta} disagrees with {key}.rope_theta "
                                     f"{rope['rope_theta']}")
                rope_theta = rope["rope_theta"]
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=heads if kv is None else kv,
            head_dim=d.get("head_dim") or 128,  # transformers' Qwen3Config default; never hidden // heads
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(10_000.0 if rope_theta is None else rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32_768),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id") if not isinstance(d.get("eos_token_id"), list)
            else d["eos_token_id"][0],
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen3Config:
        """Read a ``config.json`` file (or the one inside a checkpoint directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"no config.json at {path}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(d)

    def to_hf_dict(self, dtype: Any = jnp.float32) -> dict[str, Any]:
        """A ``config.json`` dict that transformers 4.x and 5.x both read as this architecture."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": jnp.dtype(dtype).name,
        }


def _preset(vocab, hidden, inter, layers, heads, kv, head_dim, tie, max_pos=40_960, theta=1_000_000.0):
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                       tie_word_embeddings=tie, max_position_embeddings=max_pos, rope_theta=theta)


PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": _preset(151_936, 1024, 3072, 28, 16, 8, 128, True),
    "qwen3-1.7b": _preset(151_936, 2048, 6144, 28, 16, 8, 128, True),
    "qwen3-4b": _preset(151_936, 2560, 9728, 36, 32, 8, 128, True),
    "qwen3-8b": _preset(151_936, 4096, 12288, 36, 32, 8, 128, False),
    "tiny": _preset(1000, 64, 128, 2, 4, 2, 16, True, max_pos=4096),
    "demo": _preset(2048, 256, 1024, 2, 4, 2, 64, True, max_pos=4096),
    "small": _preset(2048, 256, 768, 6, 8, 4, 32, True, max_pos=8192),
}


# Cache layout: the slot is the minor axis of the keys and the second-minor axis of the values, the layouts
# decode's two attention products (q·Kᵀ over head_dim, p·V over slots) read as stored. With [L, B, S, KVH, D]
# XLA:CPU copied a transposed window of both per layer per decode step: ~60% of a demo-size step.
CACHE_K_AXES = (None, "cache_batch", "act_kv_heads", None, "cache_seq")  # logical axes of KVCache.k
CACHE_V_AXES = (None, "cache_batch", "act_kv_heads", "cache_seq", None)  # logical axes of KVCache.v


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values, slot index == token position within the row's conversation."""

    k: jax.Array  # [L, B, KVH, D, S]
    v: jax.Array  # [L, B, KVH, S, D]

    @property
    def slots(self) -> int:
        return int(self.v.shape[3])


def cache_shapes(config: Qwen3Config, batch: int, max_len: int) -> KVCache:
    """The cache's shapes (a KVCache of tuples): k [L, B, KVH, D, S], v [L, B, KVH, S, D]."""
    c = config
    return KVCache(k=(c.num_hidden_layers, batch, c.num_key_value_heads, c.head_dim, max_len),
                   v=(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim))


LeafSharding = Callable[[tuple[int, ...], tuple[str | None, ...]], Any]


def abstract_cache(config: Qwen3Config, batch: int, max_len: int, dtype: Any,
                   sharding: LeafSharding | None = None) -> KVCache:
    """``jax.ShapeDtypeStruct`` leaves of a cache (for lowering and memory plans); ``sharding(shape, axes)``
    gives each leaf's sharding from its logical axes."""
    shapes = cache_shapes(config, batch, max_len)

    def leaf(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> jax.ShapeDtypeStruct:
        extra = {} if sharding is None else {"sharding": sharding(shape, axes)}
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), **extra)

    return KVCache(k=leaf(shapes.k, CACHE_K_AXES), v=leaf(shapes.v, CACHE_V_AXES))


def init_cache(config: Qwen3Config, batch: int, max_len: int, dtype: Any = jnp.float32) -> KVCache:
    """An all-zero cache of ``max_len`` slots per row."""
    shapes = cache_shapes(config, batch, max_len)
    return KVCache(k=jnp.zeros(shapes.k, dtype), v=jnp.zeros(shapes.v, dtype))


# Paged cache: one pool of fixed-size pages shared by every row; a row's conversation is the list of pages
# in its page table (slot s of the row lives at offset s % page_size of page table[s // page_size]). Each page
# keeps the dense cache's layout (slot minor for keys, second-minor for values), so a gathered window is the
# dense window. Pages are replicated over the mesh's row axes; kv heads over tp.
PAGE_K_AXES = (None, None, "act_kv_heads", None, None)  # logical axes of PagedKVCache.k
PAGE_V_AXES = (None, None, "act_kv_heads", None, None)  # logical axes of PagedKVCache.v


@flax.struct.dataclass
class PagedKVCache:
    """Per-layer keys/values in a pool of pages: k [L, P, KVH, D, page_size], v [L, P, KVH, page_size, D]."""

    k: jax.Array
    v: jax.Array

    @property
    def pages(self) -> int:
        return int(self.v.shape[1])

    @property
    def page_size(self) -> int:
        return int(self.v.shape[3])


def init_paged_cache(config: Qwen3Config, pages: int, page_size: int,
                     dtype: Any = jnp.float32) -> PagedKVCache:
    """An all-zero pool of ``pages`` pages of ``page_size`` slots (page 0 is the samplers' null page)."""
    c = config
    return PagedKVCache(
        k=jnp.zeros((c.num_hidden_layers, pages, c.num_key_value_heads, c.head_dim, page_size), dtype),
        v=jnp.zeros((c.num_hidden_layers, pages, c.num_key_value_heads, page_size, c.head_dim), dtype))


# Logical axis names of every parameter; see checkpoint.DEFAULT_RULES for the mapping onto mesh axes.
_LAYER_AXES: dict[str, tuple[str | None, ...]] = {
    "attn_norm": ("layers", "norm"),
    "q": ("layers", "embed", "heads", "head_dim"),
    "k": ("layers", "embed", "kv_heads", "head_dim"),
    "v": ("layers", "embed", "kv_heads", "head_dim"),
    "o": ("layers", "heads", "head_dim", "embed"),
    "q_norm": ("layers", "norm"),
    "k_norm": ("layers", "norm"),
    "mlp_norm": ("layers", "norm"),
    "gate": ("layers", "embed", "mlp"),
    "up": ("layers", "embed", "mlp"),
    "down": ("layers", "mlp", "embed"),
}


def _layer_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    L, H, N, K, D, M = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                        c.head_dim, c.intermediate_size)
    return {
        "attn_norm": (L, H), "q": (L, H, N, D), "k": (L, H, K, D), "v": (L, H, K, D), "o": (L, N, D, H),
        "q_norm": (L, D), "k_norm": (L, D), "mlp_norm": (L, H), "gate": (L, H, M), "up": (L, H, M),
        "down": (L, M, H),
    }


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def random_values(key: jax.Array, config: Qwen3Config, dtype: Any) -> dict[str, jax.Array]:
    """All parameters at once: N(0, 0.02) matrices, unit norms.

    Every matrix size is a multiple of hidden_size, so one [rows, hidden] normal draw is sliced into all of
    them (a single RNG kernel compiles in well under a second; one per tensor takes several).
    """
    c = config
    shapes = {**_layer_shapes(c), "embed": (c.vocab_size, c.hidden_size), "final_norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    matrices = sorted(n for n in shapes if not n.endswith("norm"))
    rows = [math.prod(shapes[n]) // c.hidden_size for n in matrices]
    flat = 0.02 * jax.random.normal(key, (sum(rows), c.hidden_size), jnp.float32)
    out = {n: jnp.ones(shape, dtype) for n, shape in shapes.items() if n.endswith("norm")}
    start = 0
    for n, r in zip(matrices, rows, strict=True):
        out[n] = flat[start:start + r].reshape(shapes[n]).astype(dtype)
        start += r
    return out


_random_init = jax.jit(random_values, static_argnums=(1, 2))


class Qwen3Layers(nnx.Module):
    """All decoder blocks' weights, each stacked on a leading ``layers`` axis."""

    def __init__(self, values: Mapping[str, jax.Array]):
        for name in _LAYER_AXES:
            setattr(self, name, _param(values[name], _LAYER_AXES[name]))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in _LAYER_AXES}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as transformers does it: normalize in fp32, cast back, then multiply by the weight.

    Computed on rows [-1, D]: the weight's gradient then sums over one leading axis; summed over the middle
    axis of [1, T, D] XLA:CPU took ~50 ms per norm on an 11k-token row (2-D: under 1 ms).
    """
    shape = x.shape
    x32 = x.reshape(-1, shape[-1]).astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * x32.astype(x.dtype)).reshape(shape)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split (rotate_half) layout. x: [B, T, heads, D]; positions: [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


ATTN_Q_BLOCK = 512  # query rows per attention block for long sequences
CAUSAL_Q_BLOCK = 256  # query rows per block when the mask is known to be causal (keys cut per block)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           q_block: int = ATTN_Q_BLOCK, causal: bool = False,
           dense: Callable[..., jax.Array] | None = None) -> jax.Array:
    """Grouped-query attention with fp32 softmax.

    q: [B, T, N, D]; k, v: [B, S, KVH, D]; mask: [B, T, S] bool (True = may attend). Returns [B, T, N, D].
    Query head n uses kv head n // (N // KVH), as transformers' repeat_kv does. Sequences longer than
    ``q_block`` run in rematerialized blocks of query rows (exact: each row's softmax is complete), so the
    forward and backward hold one block's [q_block, S] scores per head instead of [T, S]. With
    ``causal=True`` (the caller promises ``mask[:, t, s]`` is False for ``s > t``, S == T) each block of
    ``CAUSAL_Q_BLOCK`` rows attends only to the keys up to its last row: the same result with about half
    the score work for long sequences. ``dense``: the unblocked attention (default ``_attend_dense``; the KV
    cache's layout passes ``_attend_dense_cached``, with k [B, KVH, D, S] and v [B, KVH, S, D]).
    """
    b, t, n, d = q.shape
    if dense is None:
        dense = _attend_dense
    elif causal:
        raise ValueError("attend: causal blocks slice keys in the [B, S, KVH, D] layout; no custom dense")
    if causal and t > CAUSAL_Q_BLOCK:
        block = jax.checkpoint(lambda qb, kb, vb, mb: _attend_dense(qb, kb, vb, mb))
        outs = []
        for lo in range(0, t, CAUSAL_Q_BLOCK):
            hi = min(lo + CAUSAL_Q_BLOCK, t)
            outs.append(block(q[:, lo:hi], k[:, :hi], v[:, :hi], mask[:, lo:hi, :hi]))
        return jnp.concatenate(outs, axis=1)
    if t <= q_block:
        return dense(q, k, v, mask)
    nb = -(-t // q_block)
    pad = nb * q_block - t
    qs = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, q_block, n, d).swapaxes(0, 1)
    ms = jnp.pad(mask, ((0, 0), (0, pad), (0, 0))).reshape(b, nb, q_block, mask.shape[-1]).swapaxes(0, 1)
    block = jax.checkpoint(lambda qm: dense(qm[0], k, v, qm[1]))
    out = jax.lax.map(block, (qs, ms))  # [nb, B, q_block, N, D]
    return out.swapaxes(0, 1).reshape(b, nb * q_block, n, d)[:, :t]


def tree_block_mask(tree_exit: jax.Array, q_lo: int, q_hi: int, k_hi: int) -> jax.Array:
    """[B, q_hi - q_lo, k_hi] bool: query i may attend key j iff j <= i < tree_exit[b, j].

    Tokens are laid out in DFS preorder, so key j's subtree is the index interval [j, tree_exit[j]); a key
    is an ancestor-or-self of query i exactly when i falls in that interval. Built from iotas and a slice of
    ``tree_exit`` (4 bytes per token), never from a stored [T, T] mask.
    """
    qi = jnp.arange(q_lo, q_hi, dtype=jnp.int32)[None, :, None]
    kj = jnp.arange(k_hi, dtype=jnp.int32)[None, None, :]
    return (kj <= qi) & (qi < tree_exit[:, None, :k_hi])


def tree_attention_mask(tree_exit: jax.Array) -> jax.Array:
    """The dense [B, T, T] mask of a DFS-ordered token forest (for tests and small CPU checks)."""
    t = tree_exit.shape[-1]
    return tree_block_mask(jnp.asarray(tree_exit, jnp.int32), 0, t, t)


UNROLL_LAYERS = 4  # models this shallow run their layers unrolled (Qwen3._scan)
TREE_BLOCK = 64  # query and key rows per block of the block-sparse token-forest attention (CPU: 64 beat
#                 128 by 13% on fwd+bwd of the demo model's 11-12k-token RL rows, 32 and 256 were slower)
TREE_SPARSE_FROM = 4096  # rows longer than this run the block-sparse path; shorter ones dense causal blocks


def attend_tree(q: jax.Array, k: jax.Array, v: jax.Array, tree_exit: jax.Array,
                block: int | None = None) -> jax.Array:
    """``attend`` where each token sees exactly its ancestors in a DFS-ordered token forest.

    tree_exit: int32 [B, T], the end of each token's subtree (see ``tree_block_mask``); a packed row of
    independent sequences is the special case of chains (every token's exit = its sequence's end).

    Rows of at most ``TREE_SPARSE_FROM`` tokens (and no explicit ``block``) run dense causal query blocks of
    ``CAUSAL_Q_BLOCK`` rows against the keys up to the block's last row, the mask computed per block from
    ``tree_exit``: on CPU the fastest per pair. Longer rows (``layout.pack(long_rows=True)``) are
    block-sparse: they are cut into blocks of ``block`` (default ``TREE_BLOCK``) tokens and a query block
    visits a key block only when some key of it is visible to some query of the block (the key block does
    not lie after the query block and its largest ``tree_exit`` passes the query block's start), so a long
    row of many trees, or of a prompt with many chains below it, costs each token's ancestors rather than
    the whole causal triangle; each query block loops over a compacted list of the key blocks it needs (no
    per-block branch). Flash-style: an online softmax over the visited blocks (exact up to float
    rounding), and a custom backward that recomputes one block pair's scores at a time from the saved
    per-query log-sum-exp, so nothing of size [T, T] is ever held. A query that sees no key (an all-zero
    padding row) gets zeros.
    """
    b, t, n, d = q.shape
    blk = int(block or TREE_BLOCK)
    tree_exit = jnp.asarray(tree_exit, jnp.int32)
    if t <= blk:
        return _attend_dense(q, k, v, tree_block_mask(tree_exit, 0, t, t))
    if block is None and t <= TREE_SPARSE_FROM:
        return _attend_tree_causal(q, k, v, tree_exit)
    nb = -(-t // blk)
    pad = nb * blk - t
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        tail = jnp.broadcast_to(jnp.arange(t + 1, t + pad + 1, dtype=jnp.int32), (b, pad))
        tree_exit = jnp.concatenate([tree_exit, tail], axis=1)  # padding sees only itself
    kvh = k.shape[2]
    qs = q.reshape(b, nb, blk, kvh, n // kvh, d).swapaxes(0, 1)  # [nb, B, blk, KVH, G, D]
    ks = k.reshape(b, nb, blk, kvh, d).swapaxes(0, 1)  # [nb, B, blk, KVH, D]
    vs = v.reshape(b, nb, blk, kvh, d).swapaxes(0, 1)
    es = tree_exit.reshape(b, nb, blk).swapaxes(0, 1)  # [nb, B, blk]
    out = _tree_flash(qs, ks, vs, es)  # [nb, B, KVH, G, blk, D]
    out = jnp.moveaxis(out, 4, 2).reshape(nb, b, blk, n, d).swapaxes(0, 1)
    return out.reshape(b, nb * blk, n, d)[:, :t].astype(q.dtype)


def _attend_tree_causal(q: jax.Array, k: jax.Array, v: jax.Array, tree_exit: jax.Array) -> jax.Array:
    """Dense causal query blocks: block [lo, hi) attends keys [0, hi), its mask computed from ``tree_exit``
    inside the rematerialized block."""
    t = q.shape[1]
    outs = []
    for lo in range(0, t, CAUSAL_Q_BLOCK):
        hi = min(lo + CAUSAL_Q_BLOCK, t)

        def block(qb, kb, vb, eb, lo=lo, hi=hi):
            return _attend_dense(qb, kb, vb, tree_block_mask(eb, lo, hi, hi))

        outs.append(jax.checkpoint(block)(q[:, lo:hi], k[:, :hi], v[:, :hi], tree_exit[:, :hi]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _block_geometry(qs: jax.Array, es: jax.Array):
    """Block indices, in-block offsets and, per key block, the index no query of which it reaches."""
    nb, blk = qs.shape[0], qs.shape[2]
    return (jnp.arange(nb, dtype=jnp.int32), jnp.arange(blk, dtype=jnp.int32), es.max(axis=(1, 2)),
            qs.shape[-1] ** -0.5)


def _pair_mask(qi, ki, eb, offsets):
    """[B, 1, 1, blk q, blk k]: query qi·blk + a sees key ki·blk + c (an ancestor-or-self)."""
    blk = offsets.shape[0]
    rows, cols = qi * blk + offsets, ki * blk + offsets
    mask = (cols[None, None, :] <= rows[None, :, None]) & (rows[None, :, None] < eb[:, None, :])
    return mask[:, None, None]


def _needed(qi, ki, reach, offsets):
    return (ki <= qi) & (reach > qi * offsets.shape[0])


def _visits(qi, reach, offsets):
    """The key blocks query block ``qi`` needs, compacted to the front of an [nb] index array; their count.

    The loops below run over ``count`` entries only (a loop of dynamic length, no per-block branch): on CPU a
    scan over every key block with a ``lax.cond`` per block cost ~3x as much for the same visited pairs.
    """
    nb = reach.shape[0]
    need = _needed(qi, jnp.arange(nb, dtype=jnp.int32), reach, offsets)
    return jnp.nonzero(need, size=nb, fill_value=0)[0].astype(jnp.int32), need.sum(dtype=jnp.int32)


def _tree_flash_fwd(qs, ks, vs, es):
    ids, offsets, reach, scale = _block_geometry(qs, es)
    _, b, blk, kvh, g, d = qs.shape

    def query_block(_, args):
        qi, qb = args
        order, count = _visits(qi, reach, offsets)

        def visit(i, carry):
            m, denom, acc = carry  # [B, KVH, G, blk] ×2, [B, KVH, G, blk, D]
            ki = order[i]
            kb, vb, eb = ks[ki], vs[ki], es[ki]
            s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale
            mask = _pair_mask(qi, ki, eb, offsets)
            s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv

        init = (jnp.full((b, kvh, g, blk), _NEG, jnp.float32), jnp.zeros((b, kvh, g, blk), jnp.float32),
                jnp.zeros((b, kvh, g, blk, d), jnp.float32))
        m, denom, acc = jax.lax.fori_loop(0, count, visit, init)
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)
        return None, (out, lse)

    _, (out, lse) = jax.lax.scan(query_block, None, (ids, qs))
    return out, (qs, ks, vs, es, out, lse)


def _tree_flash_bwd(res, dout):
    qs, ks, vs, es, out, lse = res
    ids, offsets, reach, scale = _block_geometry(qs, es)
    delta = jnp.sum(dout.astype(jnp.float32) * out, axis=-1)  # [nb, B, KVH, G, blk]

    def query_block(carry, args):
        qi, qb, dob, lseb, deltab = args
        order, count = _visits(qi, reach, offsets)

        def visit(i, c):
            dq, dk, dv = c  # dq [B, blk, KVH, G, D]; dk, dv [nb, B, blk, KVH, D] fp32
            ki = order[i]
            kb, vb, eb = ks[ki], vs[ki], es[ki]
            s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale
            p = jnp.where(_pair_mask(qi, ki, eb, offsets), jnp.exp(s - lseb[..., None]), 0.0)
            dvb = jnp.einsum("bkgqs,bkgqd->bskd", p, dob, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - deltab[..., None]) * scale
            dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb, preferred_element_type=jnp.float32)
            dkb = jnp.einsum("bkgqs,bqkgd->bskd", ds, qb, preferred_element_type=jnp.float32)
            return dq, dk.at[ki].add(dkb), dv.at[ki].add(dvb)

        dk, dv = carry
        dq, dk, dv = jax.lax.fori_loop(0, count, visit, (jnp.zeros(qb.shape, jnp.float32), dk, dv))
        return (dk, dv), dq

    zeros = jnp.zeros(ks.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), (ids, qs, dout.astype(jnp.float32), lse, delta))
    return dq.astype(qs.dtype), dk.astype(ks.dtype), dv.astype(vs.dtype), None


@jax.custom_vjp
def _tree_flash(qs, ks, vs, es):
    """Blocked tree attention: qs [nb, B, blk, KVH, G, D], ks/vs [nb, B, blk, KVH, D], es [nb, B, blk]
    → [nb, B, KVH, G, blk, D] (float32)."""
    return _tree_flash_fwd(qs, ks, vs, es)[0]


_tree_flash.defvjp(_tree_flash_fwd, _tree_flash_bwd)


def _forest_kernel(q: jax.Array, k: jax.Array, v: jax.Array, tree_exit: jax.Array) -> jax.Array:
    """``attend_tree`` as one Pallas kernel (retrojax.kernels.forest_attention; imported on first use)."""
    from retrojax.kernels import forest_attention

    return forest_attention(q, k, v, tree_exit)


def _paged_decode_kernel(q: jax.Array, ck: jax.Array, cv: jax.Array, pages: jax.Array, lengths: jax.Array,
                         layer: int | jax.Array) -> jax.Array:
    """Decode attention over the pool's pages as one Pallas kernel (retrojax.kernels.paged_decode; imported
    on first use): q [B, N, D], the whole layer stack of the pool, row b seeing slots < lengths[b]."""
    from retrojax.kernels import paged_decode_attention

    return paged_decode_attention(q, ck, cv, pages, lengths, layer=layer)


def _paged_attention_kernel(q: jax.Array, ck: jax.Array, cv: jax.Array, pages: jax.Array, starts: jax.Array,
                            cap: jax.Array, layer: int | jax.Array) -> jax.Array:
    """Attention of T tokens a row over the pool's pages as one Pallas kernel
    (retrojax.kernels.paged_attention; imported on first use): q [B, T, N, D], token j of row b seeing slots
    <= starts[b] + j and < cap[b]."""
    from retrojax.kernels import paged_attention

    return paged_attention(q, ck, cv, pages, starts, cap, layer=layer)


def _unpartitioned() -> bool:
    """Whether this trace runs outside a multi-device mesh (``rules.activation_sharding``)."""
    from retrojax.parallel import rules

    active = rules._ACTIVE.get()
    return active is None or active[0].devices.size == 1


def _attend_dense(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    b, t, n, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, n // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, n, d)


def _attend_dense_cached(q: jax.Array, kt: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """``_attend_dense`` on the KV cache's layout: kt [B, KVH, D, S] (keys transposed), v [B, KVH, S, D].

    The query rows of a kv head (T tokens × its G heads) form one matrix, so both products are plain batched
    matmuls over (B, KVH) that read the cache window as stored.
    """
    b, t, n, d = q.shape
    kvh = kt.shape[1]
    g = n // kvh
    qh = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d)
    scores = jnp.einsum("bkqd,bkds->bkqs", qh, kt, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(mask[:, None, :, None, :], scores.reshape(b, kvh, t, g, -1), _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kvh, t * g, -1)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v)
    return out.reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, n, d)


MaskFn = Callable[[int, int, int], "jax.Array | None"]


def fused_implementation(q: jax.Array, s: int, masked: bool) -> str:
    """``cudnn`` where cuDNN flash attention applies (GPU, bf16/fp16, head_dim a multiple of 8 and <= 128;
    with a mask, which it takes as a bias, even query and key lengths), else ``xla``."""
    t, d = q.shape[1], q.shape[-1]
    if jax.default_backend() != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
        return "xla"
    if d % 8 or d > 128 or (masked and (t % 2 or s % 2)):
        return "xla"
    return "cudnn"


def _dpa(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, causal: bool,
         kv_lengths: jax.Array | None, implementation: str) -> jax.Array:
    m = None if mask is None else mask[:, None]  # [B, 1, T | 1, S]: every head alike
    if m is not None and implementation == "cudnn":  # cuDNN takes the mask as a full-size bias
        m = jnp.broadcast_to(m, (q.shape[0], 1, q.shape[1], k.shape[1]))
    return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=causal, key_value_seq_lengths=kv_lengths,
                                        implementation=implementation)


def attend_fused(q: jax.Array, k: jax.Array, v: jax.Array, mask_fn: MaskFn, causal: bool = False,
                  kv_lengths: jax.Array | None = None) -> jax.Array:
    """``attend`` through ``jax.nn.dot_product_attention`` (``model.attention`` kind ``fused``).

    q [B, T, N, D]; k, v [B, S, KVH, D] with fewer heads (grouped-query attention: K/V are not repeated).
    ``mask_fn(lo, hi, s)``: the bool mask [B, hi - lo | 1, s] of query rows [lo, hi) over keys [0, s), or
    None; ``causal`` (S == T): key j <= query i besides; ``kv_lengths`` int32 [B]: row b reads keys
    < kv_lengths[b] only (cuDNN skips the rest; XLA masks it). On GPU with bf16/fp16 this is one cuDNN flash
    attention call (``fused_implementation``; a shape cuDNN refuses falls back to XLA's implementation).
    XLA's implementation holds [T, S] scores per head, so rows longer than ``ATTN_Q_BLOCK`` run it in
    rematerialized query blocks (causal: each block against the keys up to its last row), as ``attend``.
    """
    t, s = q.shape[1], k.shape[1]
    if causal and s != t:
        raise ValueError(f"attend_fused: causal needs as many keys as queries, got {s} and {t}")
    impl = fused_implementation(q, s, mask_fn(0, 1, s) is not None)
    if impl == "cudnn":
        try:
            return _dpa(q, k, v, mask_fn(0, t, s), causal, kv_lengths, "cudnn")
        except (NotImplementedError, RuntimeError, ValueError):  # a cuDNN build or GPU that refuses it
            pass
    block = CAUSAL_Q_BLOCK if causal else ATTN_Q_BLOCK
    if t <= block:
        return _dpa(q, k, v, mask_fn(0, t, s), causal, kv_lengths, "xla")
    outs = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        keys = hi if causal else s

        def one(qb, kb, vb, lens, lo=lo, hi=hi, keys=keys):
            mask = mask_fn(lo, hi, keys)
            if causal:
                tri = jnp.arange(keys)[None, None, :] <= jnp.arange(lo, hi)[None, :, None]
                mask = tri if mask is None else tri & mask
            return _dpa(qb, kb, vb, mask, False, lens, "xla")

        outs.append(jax.checkpoint(one)(q[:, lo:hi], k[:, :keys], v[:, :keys], kv_lengths))
    return jnp.concatenate(outs, axis=1)


def _attend_cached_fused(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                         slots: jax.Array) -> jax.Array:
    """Attention against a cache window (k, v [B, S, KVH, D]) through ``attend_fused``: row b reads slots
    up to its last query's (``slots`` [B, T]: each query's own slot), so decode reads each row's used length
    rather than the whole window where the implementation can skip (cuDNN); one query per row needs no other
    mask, several (prefill) keep ``mask`` [B, T, S] for the slots between."""
    s = k.shape[1]
    lengths = jnp.minimum(slots[:, -1] + 1, s).astype(jnp.int32)

    def window_mask(lo: int, hi: int, keys: int) -> jax.Array | None:
        return None if q.shape[1] == 1 else mask[:, lo:hi, :keys]

    return attend_fused(q, k, v, window_mask, kv_lengths=lengths)


_ACT = ("batch", "seq", "act_embed")


def _project(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """x [B, T, *in] times weight w [*in, *out] -> [B, T, *out] (``contract`` = len(in)), as ONE 2-D matmul
    over all B·T tokens.

    Same math as the einsum; the shape is for XLA:CPU, whose dot takes a single contracting dimension: the
    weight gradient of a [B, T, ...] einsum contracts B and T (and the ``o`` projection's forward contracts
    heads and head dim), which it emitted as transposing copies of the activation gradient — the MLP's
    fwd+bwd on an 11k-token training row took 1.8 s in einsum form and 0.9 s flattened.
    """
    lead, ins, outs = x.shape[:-contract], w.shape[:contract], w.shape[contract:]
    y = jnp.dot(x.reshape(-1, math.prod(ins)), w.reshape(math.prod(ins), -1))
    return y.reshape(*lead, *outs)


def _with_adapter(out: jax.Array, x: jax.Array, p: Mapping[str, jax.Array], name: str) -> jax.Array:
    """``out`` (x times weight ``name``) plus the weight's low-rank adapter when the layer carries one.

    ``name_lora_a`` [in..., r] (already scaled by alpha / r) and ``name_lora_b`` [r, out...] come from
    retrojax.model.lora's layers; x [B, T, in...]. The adapter path runs in the adapter's dtype (fp32
    adapters on a bf16 base), as PEFT does. Without adapters this returns ``out`` untouched.
    """
    a = p.get(f"{name}_lora_a")
    if a is None:
        return out
    a = a.reshape(*x.shape[2:], a.shape[-1])
    xa = jnp.tensordot(x.astype(a.dtype), a, axes=a.ndim - 1)
    return out + jnp.tensordot(xa, p[f"{name}_lora_b"], axes=1).astype(out.dtype)


def _qkv(p: Mapping[str, jax.Array], x: jax.Array, positions: jax.Array, c: Qwen3Config):
    q = _with_adapter(_project(x, p["q"]), x, p, "q")
    k = _with_adapter(_project(x, p["k"]), x, p, "k")
    v = _with_adapter(_project(x, p["v"]), x, p, "v")
    q = constrain(q, ("batch", "seq", "act_heads", None))
    k = constrain(k, ("batch", "seq", "act_kv_heads", None))
    v = constrain(v, ("batch", "seq", "act_kv_heads", None))
    q = rope(rms_norm(q, p["q_norm"], c.rms_norm_eps), positions, c.rope_theta)
    k = rope(rms_norm(k, p["k_norm"], c.rms_norm_eps), positions, c.rope_theta)
    return q, k, v


def _finish_block(p: Mapping[str, jax.Array], h: jax.Array, attn: jax.Array, c: Qwen3Config) -> jax.Array:
    """Output projection, residual, MLP, residual (each projection one 2-D matmul: ``_project``)."""
    out = _project(attn, p["o"], contract=2)
    h = constrain(h + _with_adapter(out, attn, p, "o"), _ACT)
    x = rms_norm(h, p["mlp_norm"], c.rms_norm_eps)
    mlp = ("batch", "seq", "act_mlp")
    gate = constrain(_with_adapter(_project(x, p["gate"]), x, p, "gate"), mlp)
    up = constrain(_with_adapter(_project(x, p["up"]), x, p, "up"), mlp)
    act = jax.nn.silu(gate) * up
    return constrain(h + _with_adapter(_project(act, p["down"]), act, p, "down"), _ACT)


ATTENTION_CHOICES = ("auto", "xla", "pallas", "fused")  # model.attention
ATTENTION_PATHS = ("rows", "forest", "cache", "paged_decode", "paged_prefill")


def attention_kind(attention: str, path: str) -> str:
    """What ``model.attention`` runs for ``path`` on the default backend: ``xla`` | ``pallas`` | ``fused``.

    Paths: ``rows`` (``Qwen3.hidden`` without ``tree_exit``: the learner's ``rows`` layout), ``forest`` (with
    ``tree_exit``: ``packed``, ``tree``, ``tree_long``), ``cache`` (``hidden_cached``: prefill and decode),
    ``paged_decode`` (``hidden_cached`` over a page pool, one token per row: decode), ``paged_prefill``
    (over a page pool, several tokens per row: prefill, an append).
    Kinds: ``xla`` — the einsum blocks (``attend`` / ``attend_tree``; over pages, the gathered window);
    ``pallas`` — a Pallas kernel of retrojax.kernels (interpret mode on CPU): the forest flash attention,
    or for ``paged_decode`` / ``paged_prefill`` the paged attention kernel, which reads each row's used pages
    in place; ``fused`` —
    ``jax.nn.dot_product_attention`` (``attend_fused``: cuDNN flash attention on GPU where it applies, XLA's
    implementation elsewhere), the mask of a forest given to it densely. Settings: ``xla`` and ``fused`` run
    their kind everywhere; ``pallas`` runs the kernels for rows, forests and the page pool and ``fused`` for
    the dense cache; ``auto`` is ``xla`` on CPU and, on GPU/TPU, ``fused`` for rows and the dense cache and
    the kernels for forests (it skips the blocks no query of a forest sees, which a dense mask cannot) and the
    page pool (no gathered window).
    """
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"model.attention must be {' | '.join(ATTENTION_CHOICES)}, got {attention!r}")
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention path must be {' | '.join(ATTENTION_PATHS)}, got {path!r}")
    if attention == "auto":
        if jax.default_backend() not in ("gpu", "tpu"):
            return "xla"
        return "pallas" if path in ("forest", "paged_decode", "paged_prefill") else "fused"
    if attention == "pallas" and path == "cache":
        return "fused"
    return attention


def use_pallas_attention(attention: str) -> bool:
    """Whether ``model.attention`` runs the Pallas forest kernel for token forests (``attention_kind``)."""
    return attention_kind(attention, "forest") == "pallas"


def use_layer_copies(setting: bool | str) -> bool:
    """``sampler.layer_copies`` on the default backend: decode over per-layer weight copies, unrolled
    (``Qwen3.layer_weights``; True), or one scanned layer body over the stacked weights, no copies (False).
    ``auto``: copies on CPU only — XLA:CPU cannot feed a slice of a stacked weight to a matmul in place, so
    a scan copied every layer's weights on every step there; an accelerator's scan reads the slice in place,
    and the copies would only cost memory and compile time (one body per layer)."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"sampler.layer_copies must be auto | true | false, got {setting!r}")
    return jax.default_backend() == "cpu"


class Qwen3(nnx.Module):
    """Qwen3 causal LM. ``model(ids) -> logits``; ``hidden_cached`` for KV-cache decoding.

    ``remat=True`` rematerializes each layer in the backward pass (training memory ~ one layer's activations).
    ``attention`` (``model.attention``): the attention of ``hidden`` (the learner's rows and forests) and of
    ``hidden_cached`` (prefill and decode), resolved per path by ``attention_kind``.
    """

    def __init__(self, config: Qwen3Config, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None,
                 remat: bool = False, attention: str = "auto"):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.remat = remat
        self.attention = attention
        values = _random_init(rngs.params(), config, self.dtype)
        self.embed = _param(values["embed"], ("vocab", "embed"))
        self.layers = Qwen3Layers(values)
        self.final_norm = _param(values["final_norm"], ("norm",))
        self.lm_head = None if config.tie_word_embeddings else _param(values["lm_head"], ("vocab", "embed"))

    # ----------------------------------------------------------------------------------------------
    def head_weight(self) -> jax.Array:
        """The output projection [V, H] (the embedding when tied)."""
        return (self.embed if self.lm_head is None else self.lm_head)[...]

    def project(self, hidden: jax.Array) -> jax.Array:
        """LM head: hidden [..., H] -> float32 logits [..., V]."""
        return jnp.einsum("...h,vh->...v", hidden, self.head_weight(), preferred_element_type=jnp.float32)

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        ids = jnp.asarray(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {ids.shape}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be integers, got {ids.dtype}")
        return constrain(jnp.take(self.embed[...], ids, axis=0, mode="clip"), _ACT)

    def _scan(self, body, carry, xs):
        if self.remat:
            body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
        # Shallow stacks are unrolled: on XLA:CPU the backward of a scanned 2-layer stack ran ~25% slower
        # than the same layers unrolled. Deep ones stay a loop (compile time does not grow with depth), and
        # so does remat, a memory device whose saving XLA's unrolled schedule did not keep.
        depth = self.config.num_hidden_layers
        unroll = depth if depth <= UNROLL_LAYERS and not self.remat else 1
        return jax.lax.scan(body, carry, xs, unroll=unroll)

    def hidden(self, input_ids: jax.Array, positions: jax.Array | None = None,
               attention_mask: jax.Array | None = None, tree_exit: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states [B, T, H] for a whole sequence (causal; optional key padding mask).

        Without ``positions``: 0..T-1 per row, or, given ``attention_mask``, the count of real tokens before
        each token (so left- and right-padded rows get the same positions as unpadded ones).

        ``tree_exit`` (int32 [B, T]) lays each row out as a token forest in DFS preorder (packed sequences,
        shared prefixes): token i attends exactly to the tokens j <= i with i < tree_exit[j] (its ancestors
        and itself). ``positions`` (each token's depth) is then required and ``attention_mask`` not allowed.
        """
        c = self.config
        h = self._embed(input_ids)
        b, t = input_ids.shape
        if tree_exit is not None:
            return self._hidden_tree(h, positions, tree_exit, attention_mask)
        causal = jnp.tril(jnp.ones((t, t), bool))[None]
        if attention_mask is None:
            mask = jnp.broadcast_to(causal, (b, t, t))
            default_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        else:
            am = jnp.asarray(attention_mask).astype(bool)
            if am.shape != (b, t):
                raise ValueError(f"attention_mask shape {am.shape} != input_ids shape {(b, t)}")
            mask = causal & am[:, None, :]
            default_pos = jnp.maximum(jnp.cumsum(am, axis=1, dtype=jnp.int32) - 1, 0)
        positions = default_pos if positions is None else jnp.asarray(positions, jnp.int32)
        if positions.shape != (b, t):
            raise ValueError(f"positions shape {positions.shape} != input_ids shape {(b, t)}")
        kind = attention_kind(self.attention, "rows")
        if kind == "pallas":  # the kernel's forest: a real key's subtree is the rest of the row
            exits = jnp.full((b, t), t, jnp.int32)
            if attention_mask is not None:  # a padding key is seen by nobody
                exits = jnp.where(am, exits, jnp.arange(t, dtype=jnp.int32))

        def key_mask(lo: int, hi: int, s: int) -> jax.Array | None:  # fused: causal plus the padding keys
            return None if attention_mask is None else am[:, None, :s]

        def body(h, p):
            x = rms_norm(h, p["attn_norm"], c.rms_norm_eps)
            q, k, v = _qkv(p, x, positions, c)
            if kind == "pallas":
                attn = _forest_kernel(q, k, v, exits)
            elif kind == "fused":
                attn = attend_fused(q, k, v, key_mask, causal=True)
            else:
                attn = attend(q, k, v, mask, causal=True)
            return _finish_block(p, h, attn, c), None

        h, _ = self._scan(body, h, self.layers.arrays())
        return rms_norm(h, self.final_norm[...], c.rms_norm_eps)

    def _hidden_tree(self, h: jax.Array, positions: jax.Array | None, tree_exit: jax.Array,
                     attention_mask: jax.Array | None) -> jax.Array:
        c = self.config
        b, t = h.shape[:2]
        if attention_mask is not None:
            raise ValueError("tree_exit describes the attention; do not pass attention_mask with it")
        if positions is None:
            raise ValueError("a token tree needs positions (each token's depth)")
        positions = jnp.asarray(positions, jnp.int32)
        tree_exit = jnp.asarray(tree_exit, jnp.int32)
        if positions.shape != (b, t) or tree_exit.shape != (b, t):
            raise ValueError(f"positions {positions.shape} and tree_exit {tree_exit.shape} must be {(b, t)}")

        kind = attention_kind(self.attention, "forest")

        def forest_mask(lo: int, hi: int, s: int) -> jax.Array:  # fused: the forest's mask, dense per block
            return tree_block_mask(tree_exit, lo, hi, s)

        def attend_forest(q: jax.Array, k: jax.Array, v: jax.Array, tree_exit: jax.Array) -> jax.Array:
            if kind == "pallas":
                return _forest_kernel(q, k, v, tree_exit)
            if kind == "fused":
                return attend_fused(q, k, v, forest_mask, causal=True)
            return attend_tree(q, k, v, tree_exit)

        def body(h, p):
            x = rms_norm(h, p["attn_norm"], c.rms_norm_eps)
            q, k, v = _qkv(p, x, positions, c)
            return _finish_block(p, h, attend_forest(q, k, v, tree_exit), c), None

        h, _ = self._scan(body, h, self.layers.arrays())
        return rms_norm(h, self.final_norm[...], c.rms_norm_eps)

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, tree_exit: jax.Array | None = None) -> jax.Array:
        """Float32 logits [B, T, V]."""
        return self.project(self.hidden(input_ids, positions, attention_mask, tree_exit))

    def layer_weights(self) -> list[dict[str, jax.Array]]:
        """Each decoder block's weights as separate arrays: static slices of the stacked parameters.

        For decode loops: slice once, before the loop, and pass the list to every :meth:`hidden_cached` step.
        XLA on CPU cannot feed a slice of a stacked array to a matmul in place, so indexing the stacked
        weights per step (a layer scan does) copies every layer's weights on every step — at batch 1 the step
        is memory-bound and that copy made it 2.7x slower at the Qwen3-0.6B shape.
        """
        arrays = self.layers.arrays()
        return [{name: w[i] for name, w in arrays.items()} for i in range(self.config.num_hidden_layers)]

    def hidden_cached(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache | PagedKVCache,
                      write_start: jax.Array, window: int | None = None,
                      layers: list[dict[str, jax.Array]] | None = None,
                      pages: jax.Array | None = None) -> tuple[jax.Array, KVCache | PagedKVCache]:
        """Run T new tokens per row against the cache; returns final-norm hidden [B, T, H] and the new cache.

        Token t of row b goes to slot write_start[b] + t (slots >= S are dropped, so write_start[b] == S
        leaves row b untouched) and attends slots s <= write_start[b] + t. ``window`` (static) limits
        attention to slots ``< window``; the caller guarantees every query that matters sits below it, so
        decode cost follows the conversations' length rather than the cache's.

        ``layers``: the per-layer weights from :meth:`layer_weights`, for decode loops (sliced once outside
        the loop): the layers then run as an unrolled Python loop, with no weight copy and fusion across
        layers. Without it they run as a ``lax.scan`` over the stacked weights, which on XLA:CPU slices
        (copies) each layer's weights per call but compiles in a fraction of the time (prefill: many tokens
        per call); on an accelerator the scan reads each slice in place, so samplers decode that way there
        (``use_layer_copies``). Attention: ``model.attention``'s ``cache`` kind (``attention_kind``).
        Either way each layer scatters its keys/values at slot ``write_start[b] + t`` of the stacked cache
        (layout: ``KVCache``), which XLA updates in place when the cache is donated (in the scan it is loop
        carry: as scanned input/output the whole cache would be re-stacked every step).

        ``pages`` (int32 [B, W]) with a :class:`PagedKVCache`: row b's slot s is offset s % page_size of
        page ``pages[b, s // page_size]``; the row's view is W pages long (``window`` defaults to all of it).
        Writes at slots >= the window are dropped, and each layer attends over the row's gathered pages, laid
        out as the dense window (the same products, so the same numbers); under ``model.attention``'s
        ``paged_decode`` (one token per row) or ``paged_prefill`` (several) kind ``pallas`` the paged
        attention kernel runs instead, which reads each row's used pages in place (no gathered window; on one
        device: it is not partitioned).
        """
        c = self.config
        h = self._embed(input_ids)
        b, t = input_ids.shape
        if (pages is None) != (not isinstance(cache, PagedKVCache)):
            raise ValueError("a PagedKVCache needs page tables (pages=), a dense KVCache none")
        if pages is not None:
            return self._hidden_paged(h, input_ids, positions, cache, write_start, window, layers, pages)
        if cache.v.shape[:2] != (c.num_hidden_layers, b):
            raise ValueError(f"cache shape {cache.v.shape} does not match {c.num_hidden_layers} layers, "
                             f"batch {b}")
        if layers is not None and len(layers) != c.num_hidden_layers:
            raise ValueError(f"layers holds {len(layers)} layers' weights, the model has "
                             f"{c.num_hidden_layers}")
        s = cache.slots if window is None else min(int(window), cache.slots)
        positions = jnp.asarray(positions, jnp.int32)
        slots = jnp.asarray(write_start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= slots[:, :, None]  # [B, T, S]
        # token t of row b, kv head h -> [layer, b, h, :, slot] of k and [layer, b, h, slot] of v
        rows, heads = jnp.arange(b)[:, None, None], jnp.arange(c.num_key_value_heads)[None, None]
        at = slots[..., None]
        fused = attention_kind(self.attention, "cache") == "fused"

        def block(h, ck, cv, p, i):
            x = rms_norm(h, p["attn_norm"], c.rms_norm_eps)
            q, k, v = _qkv(p, x, positions, c)  # k, v: [B, T, KVH, D]
            ck = constrain(ck.at[i, rows, heads, :, at].set(k.astype(ck.dtype), mode="drop"), CACHE_K_AXES)
            cv = constrain(cv.at[i, rows, heads, at].set(v.astype(cv.dtype), mode="drop"), CACHE_V_AXES)
            if fused:  # [B, S, KVH, D], as dot_product_attention takes them
                kw = ck[i, :, :, :, :s].transpose(0, 3, 1, 2).astype(q.dtype)
                vw = cv[i, :, :, :s].transpose(0, 2, 1, 3).astype(q.dtype)
                attn = _attend_cached_fused(q, kw, vw, mask, slots)
            else:
                attn = attend(q, ck[i, :, :, :, :s].astype(q.dtype), cv[i, :, :, :s].astype(q.dtype), mask,
                              dense=_attend_dense_cached)
            return _finish_block(p, h, attn, c), ck, cv

        h, ck, cv = self._over_layers(block, h, cache.k, cache.v, layers)
        return rms_norm(h, self.final_norm[...], c.rms_norm_eps), KVCache(k=ck, v=cv)

    def _over_layers(self, block: Any, h: jax.Array, ck: jax.Array, cv: jax.Array,
                     layers: list[dict[str, jax.Array]] | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``block(h, ck, cv, weights, i)`` over every layer: one scanned body over the stacked weights, or
        unrolled over per-layer copies (``layers``: the sampler's decode path on CPU)."""
        if layers is None:
            params = self.layers.arrays()

            def body(carry, i):
                return block(*carry, jax.tree.map(lambda w: w[i], params), i), None

            (h, ck, cv), _ = jax.lax.scan(body, (h, ck, cv), jnp.arange(self.config.num_hidden_layers))
            return h, ck, cv
        for i, p in enumerate(layers):
            h, ck, cv = block(h, ck, cv, p, i)
        return h, ck, cv

    def _hidden_paged(self, h: jax.Array, input_ids: jax.Array, positions: jax.Array, cache: PagedKVCache,
                      write_start: jax.Array, window: int | None, layers: list[dict[str, jax.Array]] | None,
                      pages: jax.Array) -> tuple[jax.Array, PagedKVCache]:
        """:meth:`hidden_cached` over a page pool (see there)."""
        c = self.config
        b, t = input_ids.shape
        if layers is not None and len(layers) != c.num_hidden_layers:
            raise ValueError(f"layers holds {len(layers)} layers' weights, the model has "
                             f"{c.num_hidden_layers}")
        pages = jnp.asarray(pages, jnp.int32)
        if pages.shape[0] != b:
            raise ValueError(f"page tables for {pages.shape[0]} rows, batch {b}")
        ps, n_pages, kvh, d = cache.page_size, pages.shape[1], c.num_key_value_heads, c.head_dim
        span = n_pages * ps
        s = span if window is None else min(int(window), span)
        positions = jnp.asarray(positions, jnp.int32)
        slots = jnp.asarray(write_start, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= slots[:, :, None]  # [B, T, S]
        # token t of row b -> page pages[b, slot // ps] (past the window: the pool's size, i.e. dropped)
        page = jnp.take_along_axis(pages, jnp.clip(slots // ps, 0, n_pages - 1), axis=1)
        page = jnp.where(slots < s, page, cache.pages)[..., None]
        off = (slots % ps)[..., None]
        heads = jnp.arange(kvh)[None, None]
        fused = attention_kind(self.attention, "cache") == "fused"
        # the kernel is not partitioned: on a multi-device mesh (kv heads over tp) attention keeps the gather
        path = "paged_decode" if t == 1 else "paged_prefill"
        kernel = attention_kind(self.attention, path) == "pallas" and _unpartitioned()
        lengths = jnp.minimum(slots[:, 0] + 1, s)  # the kernel's rows see slots <= their query's
        cap = jnp.full((b,), s, jnp.int32)  # ... and, past the window, the whole window (as ``mask``)

        def block(h, ck, cv, p, i):
            x = rms_norm(h, p["attn_norm"], c.rms_norm_eps)
            q, k, v = _qkv(p, x, positions, c)  # k, v: [B, T, KVH, D]
            ck = constrain(ck.at[i, page, heads, :, off].set(k.astype(ck.dtype), mode="drop"), PAGE_K_AXES)
            cv = constrain(cv.at[i, page, heads, off].set(v.astype(cv.dtype), mode="drop"), PAGE_V_AXES)
            if kernel:  # the whole stack and the layer index: a layer scan copies no slice of the pool
                if t == 1:
                    attn = _paged_decode_kernel(q[:, 0], ck, cv, pages, lengths, i)[:, None]
                else:
                    attn = _paged_attention_kernel(q, ck, cv, pages, slots[:, 0], cap, i)
                return _finish_block(p, h, attn, c), ck, cv
            if fused:  # the gathered window as [B, S, KVH, D]
                kw = ck[i, pages].transpose(0, 1, 4, 2, 3).reshape(b, span, kvh, d)[:, :s]
                vw = cv[i, pages].transpose(0, 1, 3, 2, 4).reshape(b, span, kvh, d)[:, :s]
                attn = _attend_cached_fused(q, kw.astype(q.dtype), vw.astype(q.dtype), mask, slots)
                return _finish_block(p, h, attn, c), ck, cv
            kt = ck[i, pages].transpose(0, 2, 3, 1, 4).reshape(b, kvh, d, span)[..., :s]  # [B, KVH, D, S]
            vw = cv[i, pages].transpose(0, 2, 1, 3, 4).reshape(b, kvh, span, d)[:, :, :s]  # [B, KVH, S, D]
            attn = attend(q, kt.astype(q.dtype), vw.astype(q.dtype), mask, dense=_attend_dense_cached)
            return _finish_block(p, h, attn, c), ck, cv

        h, ck, cv = self._over_layers(block, h, cache.k, cache.v, layers)
        return rms_norm(h, self.final_norm[...], c.rms_norm_eps), PagedKVCache(k=ck, v=cv)


def token_logprobs(model: Qwen3, input_ids: jax.Array, targets: jax.Array, positions: jax.Array | None = None,
                   attention_mask: jax.Array | None = None, chunk: int = 512,
                   temperature: float = 1.0, tree_exit: jax.Array | None = None,
                   target_nodes: jax.Array | None = None) -> jax.Array:
    """log p(targets[b, t] | input_ids[b, :t+1]) as float32 [B, T], without materializing [B, T, V] logits.

    ``temperature`` (a Python float) scores the tempered distribution softmax(logits / T), the one a sampler
    at temperature T draws from, so a learner's ratio π_θ/π_old compares like with like; 1.0: the model's own.

    ``tree_exit`` (with ``positions``): the rows are token forests, see :meth:`Qwen3.hidden`.
    ``target_nodes`` (int32 [B, K]): score K targets per row instead of one per token: targets[b, k] is
    predicted from token target_nodes[b, k] (and its context), so a token with several children in a tree is
    scored once per child, and only the trained tokens pay for the LM head. Returns [B, K] then.

    The LM head and log-softmax run over sequence chunks inside a rematerialized scan, so the backward pass
    holds one chunk's logits at a time. Differentiable with respect to the model's parameters.
    """
    hidden = model.hidden(input_ids, positions, attention_mask, tree_exit)
    targets = jnp.asarray(targets, jnp.int32)
    if target_nodes is not None:
        nodes = jnp.asarray(target_nodes, jnp.int32)
        if nodes.shape != targets.shape or nodes.shape[0] != hidden.shape[0]:
            raise ValueError(f"target_nodes {nodes.shape} and targets {targets.shape} must both be "
                             f"[{hidden.shape[0]}, K]")
        hidden = jnp.take_along_axis(hidden, nodes[..., None], axis=1, mode="clip")
    b, t, hsz = hidden.shape
    if targets.shape != (b, t):
        raise ValueError(f"targets shape {targets.shape} != input_ids shape {(b, t)}")
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    inv_t = 1.0 / float(temperature)
    chunk = min(chunk, t)
    n = math.ceil(t / chunk)
    pad = n * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets_p = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = hidden.reshape(b, n, chunk, hsz).swapaxes(0, 1)
    ts = targets_p.reshape(b, n, chunk).swapaxes(0, 1)
    head = model.head_weight()

    @jax.checkpoint
    def one(h, tgt):
        logits = constrain(jnp.einsum("bch,vh->bcv", h, head, preferred_element_type=jnp.float32),
                           ("batch", "seq", "act_vocab"))
        if inv_t != 1.0:
            logits = logits * inv_t
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1)

    _, out = jax.lax.scan(lambda carry, x: (carry, one(*x)), None, (hs, ts))
    return out.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]


def count_params(config: Qwen3Config) -> int:
    """Number of parameters of a config, via ``nnx.eval_shape`` (nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: Qwen3(config))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
