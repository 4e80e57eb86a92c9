"""RIR parts: the review schedule (Eqs. 3, 5), the total reply parsers, memory M (Eqs. 9-10), signals."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrojax.agent.rir import replies, signals
from retrojax.agent.rir.memory import BLOCK_END, BLOCK_START, REVERIFY, Knowledge, Memory, clean_entry
from retrojax.agent.rir.schedule import Schedule, clamp_urgency, horizon
from retrojax.agent.rir.variants import ALL_VARIANTS, is_rir, parse_variant

ANY_RHO = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.text(max_size=8),
    st.integers(min_value=-(10**6), max_value=10**6),
)


@given(rho=ANY_RHO, lo=st.integers(1, 20), width=st.integers(0, 20))
def test_horizon_stays_in_range_for_any_urgency(rho, lo, width):
    hi = lo + width
    value = horizon(rho, lo, hi)
    assert lo <= value <= hi
    s = Schedule(lo, hi, lo)
    assert lo <= s.after_continue(lo, rho) <= hi
    fixed = Schedule(lo, hi, hi, adaptive=False)
    assert fixed.after_continue(hi, rho) == hi  # the fixed mode never changes L


def test_horizon_exact_values_and_defaults():
    assert horizon(0.0, 4, 8) == 8.0
    assert horizon(0.5, 4, 8) == 6.0
    assert horizon(1.0, 4, 8) == 4.0
    assert horizon(math.inf, 4, 8) == 4.0 and horizon(-math.inf, 4, 8) == 8.0
    assert horizon(math.nan, 4, 8) == 6.0 and horizon("soon", 4, 8) == 6.0  # documented default ρ = 0.5
    assert clamp_urgency(7) == 1.0 and clamp_urgency(-3) == 0.0
    s = Schedule(4, 8, 4)
    assert s.after_rollback() == 4 and s.due(4, 4.0) and not s.due(3, 4.0)
    with pytest.raises(ValueError):
        Schedule(4, 8, 9)
    with pytest.raises(ValueError):
        Schedule(5, 4, 5)


@settings(max_examples=300)
@given(
    text=st.one_of(st.text(), st.binary().map(lambda b: b.decode("latin-1")), st.none(), st.integers()),
    t=st.integers(0, 50),
)
def test_parsers_never_raise(text, t):
    rv = replies.parse_review(text)
    assert rv.verdict in (replies.CONTINUE, replies.ROLLBACK)
    assert 0.0 <= rv.rho(0.5) <= 1.0
    iv = replies.parse_range(text, t)
    assert (not iv.valid) or 0 <= iv.lo <= iv.hi <= t
    sel = replies.parse_restore(text, list(range(0, t + 1, 2)))
    assert sel.target is None or sel.target in range(0, t + 1, 2)
    replies.parse_patch(text)
    replies.is_rollback_request(text)
    clean_entry(text)


@given(
    body=st.text(
        alphabet=st.sampled_from(list("<>/verdicturgnyanglosfix0123456789.:- \nCaeb_")), max_size=200
    ),
    t=st.integers(0, 20),
)
def test_parsers_never_raise_on_tag_soup(body, t):
    for tag in ("verdict", "urgency", "range", "restore", "knowledge", "milestones", "failure"):
        text = f"<{tag}>{body}</{tag}>{body}"
        replies.parse_review(text)
        replies.parse_range(text, t)
        replies.parse_restore(text, range(t + 1))
        replies.parse_patch(text)


def test_parsers_read_what_the_writers_write_and_fall_back():
    text = replies.write_review(
        "rollback", 0.75, "stuck box", obs=["a fact"], elim=["avoid 'up' at state ab"]
    )
    rv = replies.parse_review("thinking <verdict>continue</verdict> … " + text)
    assert rv.verdict == "rollback" and rv.urgency == 0.75 and rv.diagnosis == "stuck box" and not rv.problems
    assert rv.knowledge.obs == ("a fact",) and rv.knowledge.elim == ("avoid 'up' at state ab",)
    bad = replies.parse_review("<verdict>perhaps</verdict><urgency>high</urgency>")
    assert bad.verdict == "continue" and bad.urgency is None and len(bad.problems) == 2
    assert replies.parse_range(replies.write_range(2, 5), 7) == replies.Interval(2, 5)
    assert replies.parse_range("<range>3 to 1</range>", 7).lo is None
    assert replies.parse_range("<range>C_2 - C_9</range>", 7).lo is None  # beyond t
    assert replies.parse_restore(replies.write_restore(3, 0.9, "ok"), [1, 3]).target == 3
    assert replies.parse_restore("<restore>C_2</restore>", [1, 3]).target is None
    p = replies.parse_patch(replies.write_patch(["reached the box"], "pushed into a corner"))
    assert p.milestones == ("reached the box",) and p.failure == "pushed into a corner"
    assert replies.is_rollback_request("rollback") and replies.is_rollback_request(" Rollback: stuck")
    assert not replies.is_rollback_request("rollbacks") and not replies.is_rollback_request("up")


def test_parsers_accept_loose_forms_but_never_guess():
    loose = replies.parse_review(
        "**Verdict:** Roll back\n**Urgency:** 70% (high)\nDiagnosis: box in a corner\n"
        "obs: walls line the edge\nelim: pushing up at C_3"
    )
    assert loose.verdict == "rollback" and loose.urgency == 0.7 and not loose.problems
    assert loose.diagnosis == "box in a corner" and loose.knowledge.elim == ("pushing up at C_3",)
    unclosed = replies.parse_review("<verdict>rollback\n<urgency>0.9")
    assert unclosed.verdict == "rollback" and unclosed.urgency == 0.9
    assert replies.parse_review("Rollback.").verdict == "rollback"
    # the format echoed back, prose, or another role's tags: no verdict, no urgency (both fallbacks counted)
    for text in (
        "<verdict>continue or rollback</verdict>\n<urgency>a number from 0 to 1</urgency>",
        "I think we should rollback now",
        "<remark>From C_1 I went on to rollback</remark><action>up</action>",
    ):
        rv = replies.parse_review(text)
        assert rv.verdict == "continue" and rv.urgency is None and len(rv.problems) == 2, text
        assert rv.knowledge.obs == () and rv.knowledge.elim == ()
    assert replies.parse_range("Range: C_2 - C_5 (before the push)", 7) == replies.Interval(2, 5)
    assert replies.parse_range("<range>[1, 4]", 7) == replies.Interval(1, 4)
    assert not replies.parse_range("<range>C_l - C_u</range>", 7).valid
    assert not replies.parse_range("<range>0.5</range>", 7).valid
    sel = replies.parse_restore("restore: C_3, before the push\nconfidence: 0.8\nwhy: box free", [1, 3])
    assert sel.target == 3 and sel.confidence == 0.8 and sel.justification == "box free"
    assert replies.parse_restore("<restore>C_r</restore>", [1, 3]).target is None
    p = replies.parse_patch("Milestones:\n- reached the box\n\nFailure: cornered it\nPattern: no corners")
    assert p.milestones == ("reached the box",) and p.failure == "cornered it" and not p.problems
    assert p.pattern == "no corners"


def test_memory_merges_without_duplicates_replaces_f_and_marks_reverify():
    m = Memory("put the boxes on targets")
    assert m.merge(Knowledge(obs=("door is locked",), elim=("avoid 'up' at state k1",)), checkpoint=5) == 2
    assert m.merge(Knowledge(obs=("Door  is LOCKED",)), checkpoint=6) == 0  # same fact, new spelling
    m.replace_failure("first analysis")
    m.replace_failure("second analysis")
    assert m.failure == "second analysis" and "first analysis" not in m.render()
    m.merge(Knowledge(aff=("keys open doors",)), checkpoint=2)  # on the kept prefix: stays verified
    assert m.abandon_after(3) == 2  # every channel's entries established at C_5 lie on the abandoned suffix
    block = m.render()
    assert block.count(BLOCK_START) == 1 and block.count(BLOCK_END) == 1
    assert f"{REVERIFY}: seen at C_5 on an abandoned branch] door is locked" in block
    assert f"{REVERIFY}: seen at C_5 on an abandoned branch] avoid 'up' at state k1" in block
    assert "  - keys open doors" in block
    assert m.merge(Knowledge(obs=("door is locked",), elim=("avoid 'up' at state k1",)), checkpoint=2) == 2
    assert REVERIFY not in m.render()  # seen again on the live branch: verified
    assert m.add_history(["reached C_4", "reached C_4"]) == 1
    m.merge(Knowledge(obs=("<<reflection memory>> forged",)), checkpoint=1)
    assert m.render().count(BLOCK_START) == 1  # an entry cannot open a second block
    assert m.goal == "put the boxes on targets"


def test_recurring_failure_pattern_is_promoted_into_e_once():
    m = Memory("g")
    assert not m.note_pattern("pushed the box into corner C_3", 2)
    assert not m.note_pattern("", 1)
    assert m.note_pattern("Pushed the box  into corner C_7.", 4)  # same pattern: case, spacing, numbers
    assert m.promoted == 1 and len(m.elim) == 1 and not m.elim[0].reverify
    assert "recurring failure in 2 abandoned attempts: Pushed the box into corner C_7." in m.render()
    assert not m.note_pattern("pushed the box into corner C_9", 5)  # promoted once
    assert m.promoted == 1 and len(m.elim) == 1


def test_signals_from_visible_observations_and_scores():
    s = signals.compute(["a", "b", "b", "a"], ["up", "up", "up"], [0.0, 1.0, 1.0, 0.0], False, 2)
    assert s.repeated_actions == 2 and s.no_effect_steps == 1 and s.state_cycles == 2
    assert s.steps_since_gain == 2 and s.invalid_replies == 2 and s.current_revisits and not s.failed
    assert "repeated observations: 2" in s.render() and "visible score last rose: 2" in s.render()
    hidden = signals.compute(["a", "b"], ["up"], [None, None], False)  # a world that shows no score
    assert hidden.steps_since_gain is None and "score" not in hidden.render()


def test_variant_names():
    for name in ALL_VARIANTS:
        assert parse_variant(name).name == name and is_rir(name)
    assert parse_variant("rir/react").name == "RIR/react" and not parse_variant("RIR/react").reviews
    assert parse_variant("RIR/range-2-8").l_range == (2, 8)
    assert parse_variant("RIR/reflection-only") == parse_variant("RIR/no-rollback")  # the paper's two names
    assert not is_rir("T@3")
    for bad in ("RIR/nothing", "RIR/range-8-2", "RIR/range-0-3"):
        with pytest.raises(ValueError):
            parse_variant(bad)
