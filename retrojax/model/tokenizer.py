"""Tokenizers and Qwen3's chat format, as token ids that can be appended turn by turn.

``ChatTokenizer`` wraps a text<->ids backend (a Hugging Face tokenizer, or a small sentencepiece model trained
here for the built-in demo) and renders Qwen3 chat turns::

    <|im_start|>{role}\\n{text}<|im_end|>\\n

Generation prompts are ``<|im_start|>assistant\\n`` followed, in non-thinking mode (the default), by
the empty reasoning block ``<think>\\n\\n</think>\\n\\n``. Turns are encoded one by one and appended to
existing ids, so a conversation's tokens never change once produced (Qwen3's own template re-renders earlier
assistant turns without their reasoning block; training must see exactly the tokens that were generated).
Every turn boundary sits at a special token, so appending turns gives the same ids as encoding the
rendered text in one go.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK, END_THINK = "<think>", "</think>"
CHAT_SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)
ROLES = ("system", "user", "assistant")
EMPTY_THINK = f"{THINK}\n\n{END_THINK}\n\n"
_SPM_FILE = "spm.model"
_SPM_META = "retrojax_tokenizer.json"


class ByteChatTokenizer:
    """One id per UTF-8 byte (0-255) and special ids for the chat markers (ChatML-like layout)."""

    IM_START = 256
    IM_END = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))

    def encode_turn(self, role: str, text: str) -> list[int]:
        return [self.IM_START, *self.encode(f"{role}\n{text}"), self.IM_END, *self.encode("\n")]

    def generation_prompt(self) -> list[int]:
        return [self.IM_START, *self.encode("assistant\n")]

    def close_turn(self, output_ids: Sequence[int]) -> list[int]:
        ended = len(output_ids) > 0 and int(output_ids[-1]) == self.IM_END
        return ([] if ended else [self.IM_END]) + self.encode("\n")

    @property
    def stop_ids(self) -> list[int]:
        return [self.IM_END]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", "replace")


class Backend(Protocol):
    """Text <-> ids without any added BOS/EOS; special tokens in text are recognized as single ids."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def token_id(self, token: str) -> int | None: ...
    def __len__(self) -> int: ...
    def token_bytes(self, vocab_size: int) -> list[bytes]: ...
    def save(self, path: Path) -> None: ...


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE byte -> printable character map (GPT-2 / Qwen vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


class HFBackend:
    """A transformers tokenizer (byte-level BPE for Qwen)."""

    def __init__(self, tokenizer: Any):
        self.hf = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        i = self.hf.convert_tokens_to_ids(token)
        return None if i is None or i == self.hf.unk_token_id else int(i)

    def __len__(self) -> int:
        return len(self.hf)

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        known = min(vocab_size, len(self.hf))
        pieces = self.hf.convert_ids_to_tokens(list(range(known)))
        added = {int(i): t.content for i, t in self.hf.added_tokens_decoder.items()}
        dec = _byte_decoder()
        out = []
        for i, piece in enumerate(pieces):
            if i in added:
                out.append(added[i].encode())
            elif piece is None:
                out.append(b"")
            elif all(ch in dec for ch in piece):
                out.append(bytes(dec[ch] for ch in piece))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out + [b""] * (vocab_size - known)

    def save(self, path: Path) -> None:
        self.hf.save_pretrained(path)


class SentencePieceBackend:
    """A sentencepiece model whose chat special tokens are user-defined symbols (always single pieces)."""

    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        # sentencepiece reads U+2581 in text as its space marker; spell that character with byte pieces
        self._meta_bytes = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in "\u2581".encode()]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.split("\u2581")):
            if i:
                ids += self._meta_bytes
            ids += self.sp.encode(part)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            special = {self.sp.piece_to_id(t) for t in CHAT_SPECIAL_TOKENS}
            ids = [i for i in ids if i not in special]
        return self.sp.decode(ids)

    def token_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else int(i)

    def __len__(self) -> int:
        return int(self.sp.get_piece_size())

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        out = []
        for i in range(vocab_size):
            if i >= len(self) or self.sp.is_control(i) or self.sp.is_unknown(i):
                out.append(b"")
            elif self.sp.is_byte(i):
                out.append(bytes([int(self.sp.id_to_piece(i)[3:5], 16)]))
            else:
                out.append(self.sp.id_to_piece(i).replace("\u2581", " ").encode())
        return out

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if (path / _SPM_FILE).resolve() != self.model_file.resolve():
            (path / _SPM_FILE).write_bytes(self.model_file.read_bytes())
        (path / _SPM_META).write_text(json.dumps({"kind": "sentencepiece", "model": _SPM_FILE}))


class ChatTokenizer:
    """Qwen3 chat format over any backend: turns as ids, generation prompts, stop ids, decoding."""

    def __init__(self, backend: Backend, *, thinking: bool = False):
        self.backend = backend
        self.thinking = thinking
        ids = {t: backend.token_id(t) for t in CHAT_SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks chat special token(s) {missing}; Qwen3 chat needs "
                             f"{list(CHAT_SPECIAL_TOKENS)}")
        for token, i in ids.items():
            if backend.encode(token) != [i]:
                raise ValueError(f"tokenizer does not encode {token!r} as the single id {i}")
        self.im_start_id: int = ids[IM_START]
        self.im_end_id: int = ids[IM_END]
        self.endoftext_id: int = ids[ENDOFTEXT]
        self.think_id: int = ids[THINK]
        self.end_think_id: int = ids[END_THINK]
        self._newline = backend.encode("\n")

    # ---- plain text -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (a model's vocab may be larger, padded)."""
        return len(self.backend)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn for the instruct models: ``<|im_end|>``, ``<|endoftext|>``."""
        return (self.im_end_id, self.endoftext_id)

    @property
    def pad_token_id(self) -> int:
        return self.endoftext_id

    def encode(self, text: str) -> list[int]:
        """Plain text to ids (no BOS/EOS added; chat special tokens in the text become their ids)."""
        return self.backend.encode(text)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """The bytes each id in ``0..vocab_size-1`` contributes to decoded text (b"" for unknown ids)."""
        return self.backend.token_bytes(vocab_size)

    # ---- chat format ------------------------------------------------------------------------------
    @staticmethod
    def render_turn(role: str, text: str) -> str:
        """One complete turn as text."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not isinstance(text, str):
            raise TypeError(f"turn text must be a str, got {type(text).__name__}")
        return f"{IM_START}{role}\n{text}{IM_END}\n"

    def encode_turn(self, role: str, text: str) -> list[int]:
        """Ids of one complete turn ``<|im_start|>role\\ntext<|im_end|>\\n``."""
        return self.encode(self.render_turn(role, text))

    def append_turn(self, ids: Sequence[int], role: str, text: str) -> list[int]:
        """``ids`` followed by a new turn; earlier ids are never re-rendered."""
        return [*ids, *self.encode_turn(role, text)]

    def generation_prompt(self, thinking: bool | None = None) -> list[int]:
        """Ids opening an assistant turn; non-thinking adds the empty ``<think>`` block as Qwen3 does."""
        thinking = self.thinking if thinking is None else thinking
        return self.encode(f"{IM_START}assistant\n" + ("" if thinking else EMPTY_THINK))

    def end_of_turn(self, generated: Sequence[int]) -> list[int]:
        """Ids to append after a generated assistant reply so the turn is closed like a rendered one.

        A reply that stopped on ``<|im_end|>`` needs only the newline; any other ending (``<|endoftext|>``,
        a length cut) gets ``<|im_end|>\\n``. The generated ids themselves are kept as they are.
        """
        if len(generated) and int(generated[-1]) == self.im_end_id:
            return list(self._newline)
        return [self.im_end_id, *self._newline]

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    thinking: bool | None = None) -> list[int]:
        """A whole conversation the way Qwen3's chat template renders it (system/user/assistant turns).

        Like the template, assistant turns before the last user turn lose any ``<think>`` block, and a final
        assistant turn after it gets one (empty unless the content carries reasoning). Equals
        ``apply_chat_template(messages, add_generation_prompt, enable_thinking=not thinking)``.
        """
        thinking = self.thinking if thinking is None else thinking
        for i, m in enumerate(messages):
            ok = isinstance(m, Mapping) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            if not ok:
                raise ValueError(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
        ids: list[int] = []
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role != "assistant":
                ids += self.encode_turn(role, content)
                continue
            reasoning = ""
            if END_THINK in content:
                reasoning = content.split(END_THINK)[0].rstrip("\n").split(THINK)[-1].lstrip("\n")
                content = content.split(END_THINK)[-1].lstrip("\n")
            if i > last_user and (i == len(messages) - 1 or reasoning):
                text = f"{THINK}\n{reasoning.strip(chr(10))}\n{END_THINK}\n\n{content.lstrip(chr(10))}"
            else:
                text = content
            ids += self.encode_turn("assistant", text)
        if add_generation_prompt:
            ids += self.generation_prompt(thinking)
        return ids

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer files so ``load_tokenizer(path)`` returns an equivalent tokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(path)
        return path


def load_tokenizer(path: str | Path, *, thinking: bool = False) -> ChatTokenizer:
    """A ``ChatTokenizer`` from a local directory: a sentencepiece model saved here, or any Hugging Face
    tokenizer (``AutoTokenizer``, local files only, never the hub)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    if (path / _SPM_META).exists():
        return ChatTokenizer(SentencePieceBackend(path / _SPM_FILE), thinking=thinking)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer files in {path}: {e}") from e
    return ChatTokenizer(HFBackend(hf), thinking=thinking)


def train_sentencepiece(texts: Iterable[str], vocab_size: int, path: str | Path, *,
                        model_type: str = "bpe", thinking: bool = False) -> ChatTokenizer:
    """Train a small sentencepiece tokenizer on ``texts`` (with the chat special tokens and byte fallback,
    so any text encodes), save it under ``path`` and return it as a ``ChatTokenizer``.

    ``vocab_size`` is an upper bound: a small corpus may support fewer pieces (see ``.vocab_size``).

    Text is kept verbatim (identity normalization, whitespace and newlines preserved) so decode(encode(s))
    == s. Needs vocab_size >= 300 (256 byte pieces + specials + a few merges).
    """
    import io

    import sentencepiece as spm

    texts = [t for t in texts if isinstance(t, str) and t]
    if not texts:
        raise ValueError("train_sentencepiece needs at least one non-empty text")
    # the chat scaffolding (role names after <|im_start|>) should be cheap to encode too
    scaffold = "".join(f"{IM_START}{role}\n{IM_END}\n" for role in ROLES) + EMPTY_THINK
    texts += [scaffold] * (len(texts) // 20 + 1)
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 byte pieces + specials), got {vocab_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            user_defined_symbols=[*CHAT_SPECIAL_TOKENS, "\n"], byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            split_by_whitespace=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=-1, eos_id=-1,
            pad_id=-1, max_sentence_length=1 << 16, hard_vocab_limit=False, minloglevel=2,
            num_threads=1,
        )
    except RuntimeError as e:
        raise ValueError(f"sentencepiece training failed (vocab_size={vocab_size}): {e}") from e
    (path / _SPM_FILE).write_bytes(model.getvalue())
    backend = SentencePieceBackend(path / _SPM_FILE)
    backend.save(path)
    return ChatTokenizer(backend, thinking=thinking)
