"""The typed config system: YAML → frozen dataclasses, strict keys and types, --set overrides."""

import dataclasses

import pytest

from retrojax import config as C


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_frozen():
    cfg = C.load(None)
    assert cfg.trial.max_calls == 60
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trial.max_calls = 3  # type: ignore[misc]


def test_yaml_and_overrides(tmp_path):
    p = _write(tmp_path, "trial:\n  max_calls: 40\nlearn:\n  clip_eps: 0.3\n")
    cfg = C.load(p, ["trial.branch_budget=7", "learn.lambda_state=2", "eval.protocols=[P@1, T@3]"])
    assert cfg.trial.max_calls == 40 and cfg.trial.branch_budget == 7
    assert cfg.learn.clip_eps == 0.3 and cfg.learn.lambda_state == 2.0
    assert isinstance(cfg.learn.lambda_state, float)
    assert cfg.eval.protocols == ("P@1", "T@3")


def test_unknown_key_names_key_and_file(tmp_path):
    p = _write(tmp_path, "trial:\n  max_cals: 40\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml.*trial\.max_cals"):
        C.load(p)


def test_unknown_section(tmp_path):
    p = _write(tmp_path, "trail:\n  max_calls: 40\n")
    with pytest.raises(C.ConfigError, match="trail"):
        C.load(p)


@pytest.mark.parametrize("text", ["trial:\n  max_calls: many\n", "trial:\n  max_calls: 1.5\n",
                                  "trial:\n  max_calls: true\n", "trial: 3\n"])
def test_ill_typed_values_rejected(tmp_path, text):
    with pytest.raises(C.ConfigError, match=r"c\.yaml.*trial"):
        C.load(_write(tmp_path, text))


def test_optional_and_null(tmp_path):
    cfg = C.load(_write(tmp_path, "model:\n  path: null\nenv:\n  num_tasks: 5\n"))
    assert cfg.model.path is None and cfg.env.num_tasks == 5


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(C.ConfigError, match="KEY=VALUE"):
        C.load(None, ["trial.max_calls"])
    with pytest.raises(C.ConfigError, match="trial.nope"):
        C.load(None, ["trial.nope=1"])
    with pytest.raises(C.ConfigError, match="not found"):
        C.load(tmp_path / "missing.yaml")


def test_non_mapping_and_invalid_yaml(tmp_path):
    with pytest.raises(C.ConfigError, match="mapping"):
        C.load(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(C.ConfigError, match="YAML"):
        C.load(_write(tmp_path, "trial: [\n"))


def test_replace_nested():
    cfg = C.replace(C.load(None), trial={"max_calls": 12})
    assert cfg.trial.max_calls == 12 and cfg.trial.branch_budget == 20


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    files = sorted(root.glob("*.yaml"))
    for f in files:
        C.load(f)


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("3E+2", 300.0), ("-2.5e-1", -0.25), (".5", 0.5)])
def test_float_in_exponent_form_is_accepted(tmp_path, text, value):
    """PyYAML (YAML 1.1) reads ``1e-3`` without a dot as a string; a float field still takes it."""
    cfg = C.load(None, [f"learn.learning_rate={text}"])
    assert cfg.learn.learning_rate == pytest.approx(value)
    path = tmp_path / "c.yaml"
    path.write_text(f"learn:\n  learning_rate: {text}\n")
    assert C.load(path).learn.learning_rate == pytest.approx(value)
    with pytest.raises(C.ConfigError, match="learning_rate"):
        C.load(None, ["learn.learning_rate=1e-3x"])
