"""Prompt templates for the trial loop, one family per world, in a full and a compact style.

A :class:`PromptSet` holds ``str.format`` templates with named fields. The loop fills them in
``trial.py``; which set is used is chosen by the world's ``prompt_key`` and ``cfg.trial.prompt_style``
through :func:`get_prompts`. Every family must provide the same fields (pinned by the tests):

- ``system``: role, rules and symbols, goal, that the task is solvable, the two budgets and the refund
  rule, checkpoints and the rewind syntax with when rewinding helps, the response format. Fields:
  ``max_calls``, ``branch_budget``, ``rewind_rules`` (the protocol's rewind paragraph), plus the world's
  ``prompt_fields`` (board size, …).
- ``user``: one execution turn. Fields: ``observation``, ``calls_used``, ``calls_left``,
  ``branch_used``, ``branch_left``, ``checkpoint``, ``targets``, ``events``, ``note``.
- ``memory``: the remark placed at ``C_j`` after a restore. Fields: ``checkpoint``, ``remark``.
- ``reflect_known`` (the target is known: the agent asked for it) and ``reflect_choose`` (forced
  recovery: the reflection picks the target). Fields: ``rules``, ``trigger``, ``target``, ``checkpoint``,
  ``state_target``, ``state_current``, ``history``, ``earlier``; ``reflect_choose`` also ``targets``.
- ``reflect_confirm``: the agent asked for ``C_target`` in a world whose reflections always name the
  checkpoint to restore (ScienceWorld, ALFWorld; D.2): keep the request or choose another among ``targets``.
  Fields as ``reflect_choose``. Games never use it (a valid request there gets ``reflect_known``).
- ``rewind_allowed`` / ``rewind_forbidden``: the protocol paragraph for ``system``'s ``rewind_rules``.
- ``triggers``: why a recovery started, keyed by ``model``, ``failure``, ``branch_budget`` (a cut-off reply
  is an invalid turn, not a trigger).

A reflection is its own call: its template is the whole user turn of a separate conversation c_ref (Eq. 4,
Appendix E), so it carries the rules, how going back works, the trigger, both states, the branch history and
the branch memories itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import string

STYLES = ("full", "compact")

SYSTEM_FIELDS = ("max_calls", "branch_budget", "rewind_rules")
USER_FIELDS = ("observation", "calls_used", "calls_left", "branch_used", "branch_left", "checkpoint",
               "targets", "events", "note")
MEMORY_FIELDS = ("checkpoint", "remark")
REFLECT_FIELDS = ("rules", "trigger", "target", "checkpoint", "state_target", "state_current", "history",
                  "earlier")
REFLECT_CHOOSE_FIELDS = (*REFLECT_FIELDS, "targets")
TRIGGERS = ("model", "failure", "branch_budget")


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """The templates of one world in one style (see the module docstring for the fields)."""

    system: str
    user: str
    memory: str
    reflect_known: str
    reflect_choose: str
    rules: str  # a short rules summary shown inside reflection prompts
    rewind_allowed: str
    rewind_forbidden: str
    triggers: dict[str, str]
    reflect_confirm: str = ""  # "" (a family that never needs it): the trial uses reflect_choose

    def fields(self, name: str) -> set[str]:
        """Named fields used by template ``name``."""
        return {f for _, f, _, _ in string.Formatter().parse(getattr(self, name)) if f}


_REGISTRY: dict[tuple[str, str], PromptSet] = {}


MEMORY = "Memory from an abandoned branch, kept at checkpoint C_{checkpoint}:\n{remark}"

USER_COMPACT = (
    "C_{checkpoint}:\n{observation}\n"
    "replies {calls_used}/{calls_left} left, path turns {branch_used}/{branch_left} left, "
    "rewind to: {targets}\n"
    "{events}\n{note}"
)


COMPACT_BUDGET = (
    "Budget: {max_calls} replies total, never refunded; {branch_budget} turns per path, refunded by "
    "rewinds.\n{rewind_rules}\n"
)

MODEL_TRIGGER = "You asked to go back to checkpoint C_{target}."


def triggers(*, failure: str, branch_budget: str) -> dict[str, str]:
    """The three recovery reasons, with the world's wording for a failure and an exhausted branch."""
    return {"model": MODEL_TRIGGER, "failure": failure, "branch_budget": branch_budget}


def budgets_full(counted: str) -> str:
    """The full style's budget paragraph; ``counted`` names the world's turns (``moves``, ``commands``)."""
    return (
        f"Budgets. You have {{max_calls}} replies in total ({counted}, rewinds and memory reflections all "
        "count; they are never given back). On the current path you may take at most {branch_budget} turns; "
        "going back to a checkpoint gives back the turns taken after it.\n\n"
    )


def user_full(view: str, question: str) -> str:
    """The full style's execution turn: ``view`` heads the observation, ``question`` ends the turn."""
    return (
        f"{view}:\n{{observation}}\n\n"
        "Replies used {calls_used}, left {calls_left}. "
        "Turns on this path used {branch_used}, left {branch_left}.\n"
        "Valid rewind targets: {targets}.\n"
        "Recent turns on this path:\n{events}\n"
        "{note}"
        f"{question}"
    )


def reflections_full(*, attempt: str, world: str, undone: str, view: str, item: str, avoid: str,
                     choose_keep: str = "what to avoid",
                     rewind_block: str = "<action>rewind to C_j</action> ") -> tuple[str, str, str]:
    """The full style's ``(reflect_known, reflect_choose, reflect_confirm)``.

    ``attempt`` ("a Sokoban attempt"), ``world`` (what is restored: "the board"), ``undone`` (what a restore
    takes back: "moves"), ``view`` (how a state is shown: "Board"), ``item`` (one history entry: "action"),
    ``avoid`` (what the known-target memory should name), ``choose_keep`` (the same for a chosen target) and
    ``rewind_block`` (how the chosen rewind is written, with its trailing separator).
    """
    body = (
        f"You are reviewing {attempt} before going back.\n\nRules. {{rules}}\n\n"
        f"How going back works: {world} returns to checkpoint C_{{target}}, exactly as it was; all {undone} "
        "after it are undone. What you write now is all you keep from the abandoned branch.\n\n"
        "Why: {trigger}\n\n"
        f"{view} at C_{{target}}:\n{{state_target}}\n\n{view} now (C_{{checkpoint}}):\n{{state_current}}\n\n"
        f"Branch from C_{{target}} to C_{{checkpoint}} ({item} → outcome):\n{{history}}\n\n"
        "Earlier memories:\n{earlier}\n\n"
    )
    known = body + (
        f"Write a compact memory inside <remark>…</remark>: what you did, what went wrong, {avoid}, and "
        "your plan from C_{target}."
    )
    latest = f"{view} at C_{{target}} (the latest checkpoint before the trigger)"
    choose = body.replace(
        f"{world} returns to checkpoint C_{{target}}", f"{world} returns to the checkpoint you choose"
    ).replace(f"{view} at C_{{target}}", latest) + (
        "Choose where to go back to among {targets}. Write a compact memory inside <remark>…</remark> (what "
        f"you did, what went wrong, {choose_keep}, your plan from the chosen checkpoint), then end with "
        f"{rewind_block}for your chosen j."
    )
    confirm = body.replace(
        f"{world} returns to checkpoint C_{{target}}", f"{world} returns to the checkpoint you name below"
    ).replace(f"{view} at C_{{target}}", f"{view} at C_{{target}} (the checkpoint you asked for)") + (
        "You asked to go back to C_{target}. Keep that checkpoint, or choose a better one among {targets} "
        "now that you have reviewed the branch. Write a compact memory inside <remark>…</remark> (what you "
        f"did, what went wrong, {choose_keep}, your plan from the checkpoint you return to), then end with "
        f"{rewind_block}for the checkpoint to restore (j = {{target}} keeps your request; a reply without a "
        "valid one restores C_{target})."
    )
    return known, choose, confirm


def full_set(*, system: str, user: str, reflections: tuple[str, str, str], rules: str, rewind_allowed: str,
             rewind_forbidden: str, triggers: dict[str, str]) -> PromptSet:
    """The full family: detailed system prompt and turns for large models."""
    known, choose, confirm = reflections
    return PromptSet(system=system, user=user, memory=MEMORY, reflect_known=known, reflect_choose=choose,
                     rules=rules, rewind_allowed=rewind_allowed, rewind_forbidden=rewind_forbidden,
                     triggers=triggers, reflect_confirm=confirm)


def compact_set(*, system: str, rules: str, rewind_forbidden: str, triggers: dict[str, str],
                action_style: str = "tag", target_label: str = "Latest") -> PromptSet:
    """The compact family for small models: world-specific system prompt and rules, shared turn layout.

    ``action_style`` says how a rewind is written (``tag``: ``<action>…</action>``; ``fence``: a fenced
    ```action block); ``target_label`` names the default target in the choose-target reflection.
    """
    if action_style == "fence":
        rewind, choose_tail = "Answer ```action\\nrewind to C_j\\n``` to restore", \
            "then\n```action\nrewind to C_j\n```\nwith j in {targets}."
        confirm_tail = ("then\n```action\nrewind to C_j\n```\n"
                        "with j = {target} to keep it or another j in {targets}.")
    else:
        rewind, choose_tail = "<action>rewind to C_j</action> restores", \
            "then <action>rewind to C_j</action>, j in {targets}."
        confirm_tail = ("then <action>rewind to C_j</action>: j = {target} keeps it, "
                        "or another j in {targets}.")
    review = ("{rules}\nGoing back restores that checkpoint exactly; only your remark is kept.\n"
              "Why: {trigger}\n")
    branch = "Now C_{checkpoint}:\n{state_current}\nBranch:\n{history}\nEarlier: {earlier}\n"
    return PromptSet(
        system=system, user=USER_COMPACT, memory=MEMORY,
        reflect_known="Review before going back to C_{target}. " + review + "C_{target}:\n{state_target}\n"
        + branch + "Write <remark>mistake, what to avoid, plan from C_{target}</remark>.",
        reflect_choose="Review before going back. " + review + target_label + " C_{target}:\n{state_target}\n"
        + branch + "Write <remark>mistake, what to avoid, plan</remark> " + choose_tail,
        reflect_confirm="Review before going back; you asked for C_{target}. " + review
        + "C_{target}:\n{state_target}\n" + branch + "Write <remark>mistake, what to avoid, plan</remark> "
        + confirm_tail,
        rules=rules,
        rewind_allowed=f"Checkpoint C_i = after turn i. {rewind} "
        + ("C_j " if action_style == "fence" else "C_j and keeps ")
        + ("and keep your memory; " if action_style == "fence" else "your memory; ")
        + "use it when a branch goes wrong.",
        rewind_forbidden=rewind_forbidden, triggers=triggers,
    )


def register(key: str, style: str, prompts: PromptSet) -> None:
    """Add a template family (``key`` = a world's ``prompt_key``) in ``style``."""
    if style not in STYLES:
        raise ValueError(f"prompt style must be one of {STYLES}, got {style!r}")
    _REGISTRY[(key, style)] = prompts


def _load_builtin() -> None:
    """Import every template module of this package once (each registers its families on import)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_LOADED = False


def get_prompts(key: str, style: str = "full") -> PromptSet:
    """The templates for world ``key`` in ``style`` (``full`` | ``compact``)."""
    _load_builtin()
    if (key, style) not in _REGISTRY:
        known = sorted(f"{k}/{s}" for k, s in _REGISTRY)
        raise ValueError(f"no prompt templates for {key!r} in style {style!r}; known: {', '.join(known)}")
    return _REGISTRY[(key, style)]


def registered() -> list[tuple[str, str]]:
    """All (key, style) pairs with templates."""
    _load_builtin()
    return sorted(_REGISTRY)
