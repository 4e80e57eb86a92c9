"""Stop strings detected on device, even when split across tokens.

A stop string such as ``</action>`` may arrive as one token, as ``</`` + ``action`` + ``>``, or inside a token
that carries more text (``>\\n``). We track, per row and per stop string, the state of a Knuth–Morris–Pratt
automaton over *bytes* (the length of the longest prefix of the string that is a suffix of the text so far).
Because every token is a fixed byte string, the effect of a whole token on that state is a table lookup:
``table[string, state, token] -> next state``, precomputed on host once per set of stop strings (vectorised
numpy, cached). Inside the jitted decode loop a row stops the step its state reaches the string's length.
Matching is exact, starts fresh at each ``generate`` call (text before the call never matches) and costs one
small gather per step.

On host, :func:`truncate_text` cuts the decoded text just after the earliest stop string, so the returned text
ends with the stop string (the token that completed it may carry a few more characters; those stay in the
token ids and the cache, since they are what the model produced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def bytes_to_unicode() -> dict[int, str]:
    """The byte ↔ printable-character map of byte-level BPE vocabularies (GPT-2 / Qwen).

    Printable Latin-1 bytes map to themselves; the remaining bytes map, in order, to code points from 256 up.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


def _sentencepiece_piece_bytes(piece: str) -> bytes | None:
    """Bytes of a sentencepiece piece (``▁`` is a space, ``<0xNN>`` a raw byte), or None if not one."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes_table(tokenizer, vocab_size: int) -> list[bytes]:
    """The byte string each token id contributes to decoded text, for ids ``0..vocab_size-1``.

    Works for Hugging Face byte-level BPE tokenizers (Qwen), sentencepiece-style vocabularies (``▁`` pieces
    and ``<0xNN>`` byte pieces), and added/special tokens (their literal content). Ids the tokenizer does not
    know (models pad their vocabulary) contribute no bytes. A tokenizer may also provide
    ``token_bytes(vocab_size)`` itself, which then wins.
    """
    own = getattr(tokenizer, "token_bytes", None)
    if callable(own):
        table = list(own(vocab_size))
        if len(table) != vocab_size:
            raise ValueError(f"tokenizer.token_bytes returned {len(table)} entries, expected {vocab_size}")
        return [bytes(b) for b in table]
    hf = getattr(tokenizer, "hf", None) or getattr(tokenizer, "tokenizer", None) or tokenizer
    convert = getattr(hf, "convert_ids_to_tokens", None)
    if convert is None:
        raise TypeError(
            f"cannot read token strings from {type(tokenizer).__name__}: it needs convert_ids_to_tokens "
            "(a Hugging Face tokenizer) or token_bytes(vocab_size)"
        )
    known = min(vocab_size, len(hf))
    pieces = convert(list(range(known)))
    added = {int(i): t.content for i, t in getattr(hf, "added_tokens_decoder", {}).items()}
    byte_level = sum(1 for p in pieces if p and all(ch in _BYTE_DECODER for ch in p)) > 0.9 * known
    table: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in added:
            table.append(added[i].encode("utf-8"))
        elif piece is None:
            table.append(b"")
        elif byte_level and all(ch in _BYTE_DECODER for ch in piece):
            table.append(bytes(_BYTE_DECODER[ch] for ch in piece))
        else:
            table.append(_sentencepiece_piece_bytes(piece) or b"")
    table.extend(b"" for _ in range(vocab_size - known))
    return table


def kmp_automaton(pattern: bytes) -> np.ndarray:
    """Byte-level KMP automaton ``dfa[state, byte] -> state``; states 0..m, m = matched (absorbing)."""
    m = len(pattern)
    dfa = np.zeros((m + 1, 256), dtype=np.int32)
    dfa[m, :] = m
    dfa[0, pattern[0]] = 1
    fallback = 0
    for j in range(1, m):
        dfa[j] = dfa[fallback]
        dfa[j, pattern[j]] = j + 1
        fallback = dfa[fallback, pattern[j]]
    return dfa


def token_transitions(pattern: bytes, token_bytes: Sequence[bytes]) -> np.ndarray:
    """``[m, V]`` table: the automaton state after reading each whole token from each state ``0..m-1``."""
    m = len(pattern)
    dfa = kmp_automaton(pattern)
    vocab = len(token_bytes)
    lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=vocab)
    max_len = int(lengths.max(initial=0))
    order = np.argsort(-lengths, kind="stable")  # longest first: step j touches a prefix of `order`
    padded = np.zeros((vocab, max(max_len, 1)), dtype=np.uint8)
    for i, b in enumerate(token_bytes):
        if b:
            padded[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
    state = np.broadcast_to(np.arange(m, dtype=np.int32)[:, None], (m, vocab)).copy()
    sorted_lengths = lengths[order]
    for j in range(max_len):
        live = order[: int(np.searchsorted(-sorted_lengths, -j, side="left"))]
        state[:, live] = dfa[state[:, live], padded[live, j][None, :]]
    return state


class StopStringTables:
    """Device-ready stop-string tables for one vocabulary, cached per set of stop strings."""

    def __init__(self, token_bytes: Sequence[bytes]):
        self.token_bytes = list(token_bytes)
        self._cache: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}

    def build(self, stop_strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(table [N, M, V] int16, lengths [N] int32)``, N and M padded to powers of two (few compilations).

        Padding strings have length -1 so they never match; with no stop strings a 1×1 table is returned.
        """
        key = tuple(stop_strings)
        if key not in self._cache:
            self._cache[key] = self._build(key)
        return self._cache[key]

    def _build(self, stop_strings: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        encoded = [s.encode("utf-8") for s in stop_strings]
        longest = max((len(b) for b in encoded), default=1)
        if longest >= np.iinfo(np.int16).max:
            raise ValueError(f"stop string too long ({longest} bytes)")
        n = pow2_at_least(max(len(encoded), 1))
        m = pow2_at_least(longest)
        table = np.zeros((n, m, len(self.token_bytes)), dtype=np.int16)
        lengths = np.full((n,), -1, dtype=np.int32)
        for i, pattern in enumerate(encoded):
            table[i, : len(pattern)] = token_transitions(pattern, self.token_bytes)
            lengths[i] = len(pattern)
        return table, lengths


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def truncate_text(text: str, stop_strings: Sequence[str]) -> tuple[str, str | None]:
    """Cut ``text`` just after the stop string that ends earliest; return (text, that string or None)."""
    best_end, best = None, None
    for s in stop_strings:
        at = text.find(s)
        if at >= 0 and (best_end is None or at + len(s) < best_end):
            best_end, best = at + len(s), s
    if best_end is None:
        return text, None
    return text[:best_end], best


def first_stop_token_index(
    ids: Sequence[int], stop_strings: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> int | None:
    """Number of leading ids whose decoded text first contains a stop string (host fallback), or None."""
    if not stop_strings or not any(s in decode(ids) for s in stop_strings):
        return None
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if any(s in text for s in stop_strings):
            return k
    return None
