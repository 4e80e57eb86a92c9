"""Chat messages → prompt ids with the model's own chat template.

A Hugging Face tokenizer directory that ships a ``chat_template`` renders through it
(``apply_chat_template``, non-thinking as our sampler's chat format); a tokenizer without one (the
sentencepiece tokenizers trained here) uses :meth:`retrojax.model.tokenizer.ChatTokenizer.encode_chat`, which
equals Qwen3's template.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from retrojax.serve.protocol import APIError


def _hf_tokenizer(tokenizer: Any) -> Any | None:
    hf = getattr(getattr(tokenizer, "backend", None), "hf", None)
    return hf if getattr(hf, "chat_template", None) else None


def template_name(tokenizer: Any) -> str:
    """Which renderer :func:`render_prompt` uses for ``tokenizer`` (for the startup line)."""
    return "the tokenizer's chat_template" if _hf_tokenizer(tokenizer) is not None else "Qwen3 chat format"


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, str]],
                  thinking: bool | None = None) -> list[int]:
    """Prompt ids ending with the opened assistant turn; a template that rejects the messages is a 400.
    ``thinking`` None: the tokenizer's own mode (non-thinking unless it was loaded with ``thinking=True``)."""
    hf = _hf_tokenizer(tokenizer)
    if thinking is None:
        thinking = bool(getattr(tokenizer, "thinking", False))
    try:
        if hf is None:
            return [int(i) for i in tokenizer.encode_chat(list(messages), add_generation_prompt=True,
                                                          thinking=thinking)]
        out = hf.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True,
                                     enable_thinking=thinking, return_dict=False)
    except (ValueError, TypeError, KeyError) as e:
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e
    except Exception as e:  # jinja's TemplateError (raise_exception in a template) has no common base here
        if type(e).__module__.startswith("jinja2"):
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
        raise
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]
