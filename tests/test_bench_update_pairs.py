"""bench update's attention accounting: the pairs the rows and the block-sparse tree attention compute."""

from __future__ import annotations

import numpy as np

from retrojax.bench.update import attention_pairs
from retrojax.learn.layout import Trained, pack
from retrojax.model import qwen3


def test_rows_pairs_are_the_causal_blocks():
    t, q = 3 * qwen3.CAUSAL_Q_BLOCK, qwen3.CAUSAL_Q_BLOCK
    assert attention_pairs({"input_ids": np.zeros((2, t))}) == 2 * q * q * (1 + 2 + 3)
    assert attention_pairs({"input_ids": np.zeros((4, 100))}) == 4 * 100 * 100


def test_tree_pairs_skip_blocks_no_query_sees(monkeypatch):
    monkeypatch.setattr(qwen3, "TREE_BLOCK", 8)
    monkeypatch.setattr(qwen3, "TREE_SPARSE_FROM", 16)
    prompt = np.arange(16, dtype=np.int32)  # two blocks shared by three chains of four blocks each
    items = [Trained(np.concatenate([prompt, np.full(33, c, np.int32)]), np.array([20]), {"w": np.ones(1)})
             for c in (100, 101, 102)]
    (mb,) = pack(items, lengths=(256,), max_batch_tokens=256, long_rows=True).microbatches
    assert mb["input_ids"].shape == (1, 16 + 3 * 32)  # 14 blocks: the prompt's 2, then 4 per chain
    # query blocks: the prompt's 2 visit 1 + 2 blocks; each chain's 4 visit the prompt's 2 and their own
    # chain's blocks up to themselves (1, 2, 3, 4), never the other chains'; a causal pass visits 14·15/2
    visited = 3 + 3 * (3 + 4 + 5 + 6)
    assert attention_pairs(mb) == visited * 8 * 8 < 105 * 8 * 8
