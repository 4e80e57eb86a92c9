"""Fused kernels for accelerators (Pallas), one kernel per module, each with its dense reference in
``reference``. Imports point down: this package uses only JAX, so ``retrojax.model`` may call it."""

from retrojax.kernels.forest_attention import forest_attention
from retrojax.kernels.paged_attention import paged_attention
from retrojax.kernels.paged_decode import paged_decode_attention

__all__ = ["forest_attention", "paged_attention", "paged_decode_attention"]
