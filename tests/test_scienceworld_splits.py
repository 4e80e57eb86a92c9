"""ScienceWorld's L0/L1/L2 partitions (Table 5 uses L0): types, sizes, train/test relation, via the engine."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.textworlds.scienceworld import (
    L0_EXCLUDED,
    L2_HELD_OUT,
    interleave,
    level_tasks,
    parse_task,
    split_tasks,
    task_names,
)
from retrojax import config
from retrojax.agent.env_api import make_env

pytestmark = pytest.mark.textworlds

# A few (task index, variation) pairs read from RLVMR's L0_idx.json; the index is into the engine's
# get_task_names() order. The whole file was checked against the rule by hand (see the report); these pin it.
FILE_TRAIN = [(0, 13), (20, 217), (27, 449), (15, 691), (24, 0), (13, 3)]
FILE_TEST = [(0, 14), (9, 20), (16, 119), (24, 240), (15, 1037), (13, 4), (20, 326)]


@pytest.fixture(scope="module")
def sw(tmp_path_factory):
    """One engine: fills the variation cache of every task type once, and reports the engine's task order."""
    from envs.textworlds.scienceworld import ScienceWorld

    cache = str(tmp_path_factory.mktemp("sw-splits"))
    world = ScienceWorld(cache_dir=cache)
    try:
        split_tasks(None, "train", cache_dir=cache, world=world)
        order = [str(n) for n in world._env.get_task_names()]
    finally:
        world.close()
    return cache, order


def pairs(tasks, order):
    return {(order.index(parse_task(t)[0]), parse_task(t)[1]) for t in tasks}


def test_l0_is_29_types_train_variations_for_training_and_dev_variations_for_testing(sw):
    cache, order = sw
    assert order == sorted(task_names())  # the index space of the published split
    train, test = level_tasks("L0", "train", cache), level_tasks("L0", "test", cache)
    assert (len(train), len(test)) == (3322, 1661)  # the counts of RLVMR's L0 file
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    types = {parse_task(t)[0] for t in train}
    assert types == {parse_task(t)[0] for t in test} == set(task_names()) - set(L0_EXCLUDED)
    assert len(types) == 29 and "use-thermometer" not in types
    assert not set(train) & set(test)  # same task types, no shared (type, variation) pair
    names = sorted(types)
    assert set(train) == set(split_tasks(names, "train", cache))
    assert set(test) == set(split_tasks(names, "dev", cache))
    assert not set(test) & set(split_tasks(names, "test", cache))  # ScienceWorld's own test variations unused
    assert set(FILE_TRAIN) <= pairs(train, order) and set(FILE_TEST) <= pairs(test, order)
    assert not set(FILE_TEST) & pairs(train, order)
    # interleaved: the first 29 tasks of each part are 29 different types
    assert all(len({parse_task(t)[0] for t in part[:29]}) == 29 for part in (train, test))


def test_the_config_split_trains_on_l0_train_and_evaluates_on_l0_test(sw):
    cache, _ = sw
    cfg = config.load("configs/scienceworld.yaml", [f"env.cache_dir={cache}"])
    assert cfg.env.split == "scienceworld-L0"
    train = make_env(cfg)
    test = make_env(cfg, "scienceworld-L0:test")
    try:
        assert train.split == "scienceworld-L0:train" and train.num_tasks == 3322
        assert test.split == "scienceworld-L0:test" and test.num_tasks == 1661
        assert test.tasks == level_tasks("L0", "test", cache)
    finally:
        train.close()
        test.close()
    few = make_env(config.load("configs/scienceworld.yaml", [f"env.cache_dir={cache}", "env.num_tasks=60"]),
                   "scienceworld-L0:test")
    assert len({parse_task(t)[0] for t in few.tasks}) == 29  # a 60-task prefix spans every type
    with pytest.raises(ValueError, match="parts"):
        make_env(cfg, "scienceworld-L0:dev")
    with pytest.raises(ValueError, match="unknown ScienceWorld partition"):
        make_env(cfg, "scienceworld-L3:test")


def test_l1_tests_on_scienceworlds_test_variations_and_l2_on_ten_unseen_types(sw):
    cache, order = sw
    l0_train = level_tasks("L0", "train", cache)
    l1_train, l1_test = level_tasks("L1", "train", cache), level_tasks("L1", "test", cache)
    l2_train, l2_test = level_tasks("L2", "train", cache), level_tasks("L2", "test", cache)
    # RLVMR's counts
    assert [len(x) for x in (l1_train, l1_test, l2_train, l2_test)] == [3322, 1684, 2242, 549]
    types = sorted(set(task_names()) - set(L0_EXCLUDED))
    assert l1_train == l0_train and set(l1_test) == set(split_tasks(types, "test", cache))
    assert not set(l1_test) & set(l1_train) and not set(l1_test) & set(level_tasks("L0", "test", cache))
    train_types, test_types = ({parse_task(t)[0] for t in part} for part in (l2_train, l2_test))
    assert test_types == set(L2_HELD_OUT) and not train_types & test_types  # unseen task types
    assert train_types | test_types == set(types) and len(train_types) == 19
    assert set(l2_train) <= set(l0_train) and set(l2_test) <= set(l1_test)
    assert pairs(l2_test, order) >= {(1, 29), (24, 479), (16, 120)}  # pairs read from RLVMR's L2 file


@given(st.lists(st.lists(st.integers(0, 99), max_size=6), max_size=5))
def test_interleave_keeps_every_item_and_each_group_order(groups):
    named = [[f"{g}-{i}-{x}" for i, x in enumerate(items)] for g, items in enumerate(groups)]
    out = interleave(named)
    assert sorted(out) == sorted(x for g in named for x in g)
    for g in named:
        assert [x for x in out if x in set(g)] == g
    heads = [g[0] for g in named if g]
    assert out[: len(heads)] == heads
