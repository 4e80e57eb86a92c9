"""The config fields (``section.field``) and CLI flags (``--flag``) that README.md and docs/*.md name in code
exist: fields in the dataclasses of ``retrojax.config``, flags in the parser ``retrojax.cli`` builds."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from retrojax import config as config_lib
from retrojax.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Names under a config section that are not config fields: the figures `retrojax bench` prints share the
# section's prefix. Each entry: the name's first component after the section, and why it is not a field.
NOT_FIELDS = {
    "learn": {
        "recipe": "bench learn key", "wall_s": "bench learn key", "rl_wall_s": "bench learn key",
        "success": "bench learn key", "heldout": "bench learn key", "curve": "bench learn key",
        "report": "bench learn key", "sft": "bench learn key (learn.sft.steps, learn.sft.pool_checks)",
        "window_updates": "bench learn key", "expert_first_move": "bench learn key",
        "mixed_groups": "bench learn key", "solved_groups": "bench learn key",
        "failed_groups": "bench learn key",
    },
    "sft": {"speedup": "bench update key (sft.speedup, sft.speedup_long)",
            "speedup_long": "bench update key", "L": "bench update key pattern (sft.L.*)"},
    "env": {"step": "a Python method named in prose (the wrapper's env.step)"},
    "api": {"usage": "a key of the eval report (api.usage)"},
}
# `name.ext` in a command is a file name (`--json learn.json`), not a field.
FILE_EXTENSIONS = {"json", "jsonl", "yaml", "yml", "md", "py", "txt", "log", "npz", "html", "ipynb"}
# Flags that belong to other tools shown in the docs' commands, each with its tool.
OTHER_FLAGS = {
    "--strict": "mkdocs build", "--durations": "pytest", "--no-loadscope-reorder": "pytest-xdist",
    "--idle": "py-spy record", "--rate": "py-spy record", "--format": "py-spy record",
}
OTHER_PREFIXES = {"--xla_": "XLA's own flags, set through XLA_FLAGS"}

_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
_INLINE = re.compile(r"`([^`]+)`")
_FIELD = re.compile(r"(?<![\w./\-{])([a-z_]+)\.([A-Za-z_][A-Za-z0-9_]*)(?:\.([a-z_][a-z0-9_]*))?(?![\w(])")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*)")


def code_text(path: Path) -> list[str]:
    """The code of one Markdown file: fenced blocks and inline code spans (which may wrap lines)."""
    text = path.read_text()
    blocks = _FENCE.findall(text)
    return blocks + _INLINE.findall(_FENCE.sub("", text))


def _sections() -> dict[str, type]:
    return {f.name: f.type if isinstance(f.type, type) else typing.get_type_hints(config_lib.Config)[f.name]
            for f in dataclasses.fields(config_lib.Config)}


def _field_type(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` of ``cls`` (None if it is not a dataclass), or KeyError."""
    hints = typing.get_type_hints(cls)
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise KeyError(name)
    t = hints[name]
    return t if dataclasses.is_dataclass(t) else None


def missing_fields(snippets: list[str]) -> set[str]:
    """``section.field`` names in ``snippets`` that no config dataclass has."""
    sections, bad = _sections(), set()
    for snippet in snippets:
        for section, name, sub in _FIELD.findall(snippet):
            if (section not in sections or name in NOT_FIELDS.get(section, {}) or name in FILE_EXTENSIONS
                    or name.startswith("_")):  # a private function (sampler._prefill), not a field
                continue
            try:
                inner = _field_type(sections[section], name)
                if inner is not None and sub:
                    _field_type(inner, sub)
            except KeyError:
                bad.add(f"{section}.{name}" + (f".{sub}" if sub else ""))
    return bad


def cli_flags(parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Every option string of the ``retrojax`` parser and its subcommands."""
    parser = parser or build_parser()
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= cli_flags(sub)
    return out


def missing_flags(snippets: list[str]) -> set[str]:
    known = cli_flags() | set(OTHER_FLAGS)
    return {flag for snippet in snippets for flag in _FLAG.findall(snippet)
            if flag not in known and not flag.startswith(tuple(OTHER_PREFIXES))}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_config_fields_exist(path):
    assert not missing_fields(code_text(path)), sorted(missing_fields(code_text(path)))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_cli_flags_exist(path):
    assert not missing_flags(code_text(path)), sorted(missing_flags(code_text(path)))


def test_a_missing_name_is_caught():
    """The checks fail on names that do not exist, nested ones included, and pass on real ones."""
    assert missing_fields(["--set learn.kl_coef=0.05 and `learn.lora.rank`"]) == set()
    assert missing_fields(["--set learn.no_such_field=1"]) == {"learn.no_such_field"}
    assert missing_fields(["learn.lora.no_such"]) == {"learn.lora.no_such"}
    assert missing_flags(["retrojax bench learn --recipe transfer --compare"]) == set()
    assert missing_flags(["retrojax bench parallel --device-gb 80"]) == {"--device-gb"}
