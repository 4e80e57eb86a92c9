"""learn.layout=tree_long: validated at load, reaching the RL batches and the SFT steps."""

from __future__ import annotations

import numpy as np
import pytest

from retrojax import config
from retrojax.config import ConfigError, LearnConfig
from retrojax.learn import sft
from retrojax.learn.advantages import compute_advantages
from retrojax.learn.batch import plan_batches
from retrojax.learn.layout import LAYOUTS, forest_options
from retrojax.learn.synthetic import synthetic_archive
from retrojax.learn.trainer import validate_learn_config


def test_layout_values_are_checked_when_the_config_loads():
    for layout in LAYOUTS:
        assert config.load(None, [f"learn.layout={layout}"]).learn.layout == layout
    assert config.load(None).learn.layout == "tree_long"  # the default (docs/benchmarks.md#update)
    with pytest.raises(ConfigError, match="learn.layout' expects one of rows | packed | tree | tree_long"):
        config.load(None, ["learn.layout=long"])
    with pytest.raises(ConfigError, match="expects one of"):
        config.from_dict({"learn": {"layout": 1}})
    with pytest.raises(ValueError, match="learn.layout must be rows | packed | tree | tree_long"):
        validate_learn_config(LearnConfig(layout="bucket"))
    with pytest.raises(ValueError, match="token-forest layout"):
        forest_options("rows")


def _plan(layout: str):
    arch = synthetic_archive(np.random.default_rng(2), tasks=2, trials=4, vocab=64, segments=3, decisions=3,
                             prompt_len=40, turn_len=8, output_len=6)
    adv = compute_advantages(arch, "sa_grpo")
    return plan_batches(arch, adv, lambda_ref=0.5, seq_buckets=(64, 128), max_batch_tokens=1024,
                        layout=layout)


def test_tree_long_lays_a_task_tree_in_one_row():
    rows, tree, long = _plan("rows"), _plan("tree"), _plan("tree_long")
    assert long.stats["batch/trained_tokens"] == tree.stats["batch/trained_tokens"] \
        == rows.stats["batch/trained_tokens"] > 0
    assert all(mb.arrays["input_ids"].shape[0] == 1 for mb in long.microbatches)  # one row each
    assert max(mb.arrays["input_ids"].shape[1] for mb in long.microbatches) > 128  # longer than any bucket
    # fewer positions than the bucket rows: every shared prefix of a task tree once
    assert long.stats["batch/padded_tokens"] < tree.stats["batch/padded_tokens"] \
        < rows.stats["batch/padded_tokens"]


def test_sft_steps_take_tree_long():
    first = np.arange(30, dtype=np.int32) % 17
    ids = [first, np.r_[first[:20], (np.arange(20, dtype=np.int32) + 5) % 17]]  # a 20-token shared prefix
    own = [np.r_[np.zeros(20, bool), np.ones(10, bool)], np.r_[np.zeros(20, bool), np.ones(20, bool)]]
    examples = [sft.Example(i, o) for i, o in zip(ids, own, strict=True)]
    rows = sft.make_batch(examples, 2, (32, 64), layout="rows")
    long = sft.make_batch(examples, 2, (32, 64), layout="tree_long")
    tree = sft.make_batch(examples, 2, (32, 64), layout="tree")
    assert long["input_ids"].shape[0] == 1  # both examples in one row, the 20-token prefix once
    assert long["loss_mask"].sum() == tree["loss_mask"].sum() == rows["loss_mask"].sum() == 30
    assert list(long["positions"][0, 20:29]) == list(range(20, 29))  # the first example below the prefix
    assert long["positions"][0, 29] == 20  # the second one branches off at depth 20
    with pytest.raises(ValueError, match="tree_long"):
        sft.make_batch(examples, 2, (32, 64), layout="long")
