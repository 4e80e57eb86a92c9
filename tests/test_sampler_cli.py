"""``retrojax generate`` on a tiny checkpoint with a sentencepiece chat tokenizer saved next to it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import make_tiny_hf_checkpoint

from retrojax.cli import main as cli
from retrojax.generate import reply
from retrojax.model.checkpoint import from_pretrained
from retrojax.model.tokenizer import load_tokenizer, train_sentencepiece

TEXTS = ["push the box to the goal", "the agent moves left and right", "<action>up</action> done"] * 30


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gen"), seed=5)
    train_sentencepiece(TEXTS, 400, path)
    return path


def test_generate_cli_prints_the_greedy_reply(ckpt, capsys):
    rc = cli(["generate", "--model", str(ckpt), "--prompt", "push the box", "--max-new-tokens", "6"])
    assert rc == 0
    printed = capsys.readouterr()
    assert "finish:" in printed.err
    model, tok = from_pretrained(ckpt, dtype=jnp.float32), load_tokenizer(ckpt)
    out = reply(model, tok, "push the box", max_new_tokens=6)
    assert printed.out == out.text + "\n"
    # the same reply by greedy decoding with full forward passes
    ids = tok.encode_chat([{"role": "user", "content": "push the box"}])
    for _ in range(out.ids.size):
        ids.append(int(np.argmax(np.asarray(model(jnp.asarray([ids])))[0, -1])))
    np.testing.assert_array_equal(out.ids, ids[-out.ids.size:])


def test_generate_cli_reports_missing_directories(tmp_path, capsys):
    assert cli(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
