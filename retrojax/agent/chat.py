"""Chat tokenization for the trial loop: the interface the loop needs, and a byte-level fallback.

The loop keeps each trial's conversation as token ids (a :class:`Transcript`) so that every call's exact
input ids can be recorded in the archive and a sampler row can mirror it. It needs only four things from a
tokenizer, the :class:`ChatTokenizer` protocol:

- ``encode_turn(role, text)``: ids of one whole chat turn (``system`` / ``user``), including its markers;
- ``generation_prompt()``: ids that open the assistant turn the model then writes;
- ``encode(text)``: plain ids of some text (how scripted policies' replies become output ids);
- ``close_turn(output_ids)``: ids to append after a generated reply so that the assistant turn is closed
  (the end-of-turn token unless the reply already ended with it, plus the separator after it).

``ByteChatTokenizer`` implements it with one id per UTF-8 byte plus a few special ids, so the loop and the
archive are complete without any model (scripted policies, learner tests). ``ModelPolicy`` brings the
model's own tokenizer through :func:`wrap_tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

# the byte-level fallback lives beside the model's tokenizers (the model builder needs it too)
from retrojax.model.tokenizer import ByteChatTokenizer

__all__ = ["ByteChatTokenizer", "ChatTokenizer", "Transcript", "wrap_tokenizer"]

import numpy as np


class ChatTokenizer(Protocol):
    def encode_turn(self, role: str, text: str) -> list[int]: ...

    def generation_prompt(self) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def close_turn(self, output_ids: Sequence[int]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class _Wrapped:
    """Adapts a model tokenizer (``retrojax.model.tokenizer``) to :class:`ChatTokenizer`."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.end_id = int(_end_of_turn_id(tok))
        self._sep = list(_plain_encode(tok, "\n"))

    def encode(self, text: str) -> list[int]:
        return list(_plain_encode(self.tok, text))

    def encode_turn(self, role: str, text: str) -> list[int]:
        return [int(i) for i in self.tok.encode_turn(role, text)]

    def generation_prompt(self) -> list[int]:
        gp = self.tok.generation_prompt
        return [int(i) for i in (gp() if callable(gp) else gp)]

    def close_turn(self, output_ids: Sequence[int]) -> list[int]:
        if hasattr(self.tok, "end_of_turn"):
            return [int(i) for i in self.tok.end_of_turn(list(output_ids))]
        ended = len(output_ids) > 0 and int(output_ids[-1]) == self.end_id
        return ([] if ended else [self.end_id]) + self._sep

    @property
    def stop_ids(self) -> list[int]:
        ids = getattr(self.tok, "stop_token_ids", None) or getattr(self.tok, "stop_ids", None)
        ids = ids() if callable(ids) else ids
        return [int(i) for i in ids] if ids else [self.end_id]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def _end_of_turn_id(tok: Any) -> int:
    for name in ("im_end_id", "eot_id"):
        value = getattr(tok, name, None)
        if value is not None:
            return int(value() if callable(value) else value)
    ids = getattr(tok, "stop_token_ids", None) or getattr(tok, "stop_ids", None)
    ids = ids() if callable(ids) else ids
    if ids:
        return int(list(ids)[0])
    raise ValueError("the tokenizer exposes no end-of-turn id (im_end_id / stop_ids)")


def _plain_encode(tok: Any, text: str) -> list[int]:
    try:
        return [int(i) for i in tok.encode(text, add_special_tokens=False)]
    except TypeError:
        return [int(i) for i in tok.encode(text)]


def wrap_tokenizer(tok: Any) -> ChatTokenizer:
    """A :class:`ChatTokenizer` view of ``tok`` (returned unchanged when it already is one)."""
    if all(hasattr(tok, n) for n in ("encode_turn", "generation_prompt", "encode", "close_turn", "decode")):
        return tok
    return _Wrapped(tok)


class Transcript:
    """A conversation as a growing int32 buffer; marks are lengths, a rewind is a truncation."""

    def __init__(self, capacity: int = 1024):
        self._buf = np.zeros(max(16, capacity), np.int32)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, ids: Sequence[int] | np.ndarray) -> None:
        ids = np.asarray(ids, np.int32).reshape(-1)
        need = self._len + ids.size
        if need > self._buf.size:
            grown = np.zeros(max(need, 2 * self._buf.size), np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : need] = ids
        self._len = need

    def truncate(self, position: int) -> None:
        if not 0 <= position <= self._len:
            raise IndexError(f"cannot truncate a transcript of {self._len} tokens to {position}")
        self._len = position

    def ids(self) -> np.ndarray:
        """A copy of the conversation so far."""
        return self._buf[: self._len].copy()
