"""Replays that are exact up to listing order (no Java): the canonical form and the worker's checks.

A fake world reproduces what ScienceWorld does (measured on find-living-thing:225): every reset lists
three identically named cups in a new order, and a numbered answer to an ambiguous request picks the
cup at that position of the current order. Replays must accept the reordered listing, retry a pick that
reached another cup, and still report a real divergence with a clear error.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.textworlds.base import Observation, ReplayDivergence, TextWorld, digest
from envs.textworlds.canonical import listing_canonical
from envs.textworlds.pool import Call, _WorkerState

WORDS = st.sampled_from(["a wood cup", "a bowl", "red paint", "blue paint", "water", "an orange", "a table"])


@st.composite
def items(draw, depth: int = 0) -> str:
    name = draw(WORDS)
    if depth < 2 and draw(st.booleans()):
        inner = draw(st.lists(items(depth + 1), min_size=1, max_size=3))
        name += " (containing " + ", ".join(inner) + ")"
    return name


LINES = st.lists(st.lists(items(), min_size=1, max_size=4), min_size=1, max_size=5)


def render(lines: list[list[str]]) -> str:
    return "\n".join("\t" + ", ".join(line) for line in lines)


@settings(max_examples=100, deadline=None)
@given(LINES, st.randoms(use_true_random=False))
def test_canonical_form_forgets_order_only(lines, rnd):
    shuffled = [rnd.sample(line, len(line)) for line in lines]
    shuffled = rnd.sample(shuffled, len(shuffled))
    assert listing_canonical(render(shuffled)) == listing_canonical(render(lines))
    # a different content in one item, or an item moved to another line, is still a difference
    changed = [list(line) for line in lines]
    changed[0][0] = changed[0][0] + " (containing mercury)"
    assert listing_canonical(render(changed)) != listing_canonical(render(lines))
    if len(lines) >= 2 and len(lines[0]) >= 2:
        moved = [list(line) for line in lines]
        moved[1].append(moved[0].pop(0))
        same_lines = Counter(map(line_multiset, moved)) == Counter(map(line_multiset, lines))
        assert (listing_canonical(render(moved)) == listing_canonical(render(lines))) == same_lines


def line_multiset(line: list[str]) -> frozenset:
    return frozenset(Counter(line).items())


def test_canonical_form_examples():
    a = "a counter. On the counter is: a bowl (containing a red apple, a banana), a cup (containing water)."
    b = "a counter. On the counter is: a cup (containing water), a bowl (containing a banana, a red apple)."
    c = "a counter. On the counter is: a cup (containing a banana, water), a bowl (containing a red apple)."
    assert listing_canonical(a) == listing_canonical(b) != listing_canonical(c)
    room = "In it, you see:\n\ta table. On the table is: a bowl.\n\ta counter. On the counter is: a cup."
    swap = "In it, you see:\n\ta table. On the table is: a cup.\n\ta counter. On the counter is: a bowl."
    assert listing_canonical(room) != listing_canonical(swap)


@given(st.text(max_size=200))
def test_canonical_form_never_raises(text):
    assert isinstance(listing_canonical(text), str)


PAINTS = ("red", "blue", "yellow")


class ReshufflingWorld(TextWorld):
    """Three identically named cups, listed in a new order at each reset (seeded); ``pick`` + a number."""

    name = "reshuffling"

    def __init__(self, seed: int = 0, order_attempts: int = 64, replay_attempts: int = 3,
                 sticky_temperature: bool = False):
        self.rng = random.Random(seed)
        self.order_attempts, self.replay_attempts = order_attempts, replay_attempts
        self.sticky_temperature = sticky_temperature  # a world that is NOT deterministic up to order
        self.resets = 0

    def _obs(self, text: str, valid: bool = True) -> Observation:
        key = digest(listing_canonical(self._look()), ",".join(sorted(self.held)), str(self.temperature))
        return Observation(text=text, score=0.0, progress=0.0, done=False, won=False, valid=valid, key=key)

    def _look(self) -> str:
        return "In the room:\n" + "\n".join(f"\ta wood cup (containing {p} paint)" for p in self.order)

    def reset(self, task: str) -> Observation:
        self.resets += 1
        self.order = self.rng.sample(PAINTS, 3)
        self.held: list[str] = []
        self.pending = False
        self.temperature = self.rng.randint(0, 1) if self.sticky_temperature else 0
        return self._obs(self._look())

    def step(self, action: str, full: bool = True) -> Observation:
        if action == "pick up wood cup":
            self.pending = True
            return self._obs("Ambiguous request:\n" + "\n".join(f"{i}: pick up wood cup" for i in range(3)))
        if self.pending and action.isdigit() and int(action) < len(self.order):
            self.pending = False
            self.held.append(self.order.pop(int(action)))
            return self._obs("You move the wood cup to the inventory.")
        if action == "look around":
            return self._obs(self._look())
        return self._obs("No known action matches that input.", valid=False)

    def admissible(self) -> dict[str, list[str]]:
        return {}

    def candidates(self) -> list[str]:
        return []

    def expert_action(self) -> str | None:
        return None

    def goal(self) -> str:
        return "hold the red cup"

    def order_dependent(self, action: str) -> bool:
        return action.isdigit()

    def canonical(self, text: str) -> str:
        return listing_canonical(text)

    def close(self) -> None:
        pass


def record(world: ReshufflingWorld, path: list[str]) -> list[Observation]:
    obs = [world.reset("t")]
    obs += [world.step(a) for a in path]
    return obs


def restore(state: _WorkerState, path: list[str], cps: list[Observation]) -> Observation:
    cp = cps[len(path)]
    call = Call(op="restore", task="t", path=tuple(path), expected=cp.text, expected_key=cp.key, fresh=True,
                path_keys=tuple(c.key for c in cps[1 : len(path) + 1]))
    return state.run(call)[0]


def test_reordered_listing_restores_exactly_and_a_pick_is_retried_until_the_same_cup():
    world = ReshufflingWorld(seed=3)
    state = _WorkerState(world, cache_size=0)
    path = ["pick up wood cup", "0", "look around"]
    cps = record(world, path)
    held = list(world.held)
    for j in range(len(path) + 1):
        for _ in range(4):
            world.resets = 0
            obs = restore(state, path[:j], cps)
            assert obs.key == cps[j].key and listing_canonical(obs.text) == listing_canonical(cps[j].text)
            if j >= 2:
                assert world.held == held  # the very cup the record picked, not just any cup
            assert 1 <= world.resets <= world.order_attempts


def test_exact_text_check_alone_would_accept_the_wrong_cup():
    """The pick's own reply is the same text for any cup: only the state key tells them apart."""
    world = ReshufflingWorld(seed=5, order_attempts=1)
    state = _WorkerState(world, cache_size=0)
    path = ["pick up wood cup", "0"]
    cps = record(world, path)
    outcomes = set()
    for _ in range(30):
        try:
            restore(state, path, cps)
            outcomes.add("ok")
        except ReplayDivergence as e:
            assert "reached another state than recorded" in str(e)
            outcomes.add("diverged")
    assert outcomes == {"ok", "diverged"}


def test_a_real_divergence_is_an_error_after_the_attempts():
    world = ReshufflingWorld(seed=7, replay_attempts=3)
    state = _WorkerState(world, cache_size=0)
    path = ["look around"]
    cps = record(world, path)
    wrong = cps[1].text.replace("red paint", "green paint")
    world.resets = 0
    with pytest.raises(ReplayDivergence, match=r"diverged.*only recorded.*green paint.*after 3 replays"):
        state.run(Call(op="restore", task="t", path=tuple(path), expected=wrong, expected_key=cps[1].key,
                       fresh=True))
    assert world.resets == 3 and state.at is None


def test_a_state_that_differs_beyond_order_is_never_accepted():
    """A hidden variable re-drawn at each reset (like ScienceWorld's stochastic heat transfer): a replay
    either reaches the recorded value (checked by key) or fails; it never returns another state."""
    world = ReshufflingWorld(seed=11, sticky_temperature=True)
    state = _WorkerState(world, cache_size=0)
    cps = record(world, ["look around"])
    recorded_temperature = world.temperature
    for _ in range(20):
        try:
            obs = restore(state, ["look around"], cps)
        except ReplayDivergence as e:
            assert "world's state" in str(e)
            continue
        assert obs.key == cps[1].key and world.temperature == recorded_temperature
