"""``retrojax generate``: one chat-formatted reply from a local checkpoint, through the KV-cache sampler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from retrojax.sampling.stops import pow2_at_least


def reply(model, tokenizer, prompt: str, *, max_new_tokens: int = 128, temperature: float = 0.0,
          seed: int = 0):
    """The model's reply to one user turn (Qwen3 chat format, non-thinking) as a ``Generation``."""
    from retrojax.sampler import Sampler

    ids = tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    max_len = pow2_at_least(len(ids) + max_new_tokens, 64)
    sampler = Sampler(model, rows=1, max_len=max_len, tokenizer=tokenizer, chunk_buckets=(64, 512))
    sampler.append([0], [ids])
    valid_stops = [i for i in tokenizer.stop_token_ids if i < model.config.vocab_size]
    return sampler.generate([0], max_new_tokens, temperature=temperature, stop_token_ids=valid_stops,
                            key=jax.random.key(seed))[0]


def main(args: argparse.Namespace) -> int:
    from retrojax.model.checkpoint import from_pretrained
    from retrojax.model.tokenizer import load_tokenizer

    model_dir = Path(args.model)
    tok_dir = Path(args.tokenizer) if args.tokenizer else model_dir
    if args.max_new_tokens < 0 or args.temperature < 0:
        print("error: --max-new-tokens and --temperature must be >= 0", file=sys.stderr)
        return 2
    for what, path in (("model", model_dir), ("tokenizer", tok_dir)):
        if not path.is_dir():
            print(f"error: {what} directory {path} does not exist", file=sys.stderr)
            return 2
    try:
        model = from_pretrained(model_dir, dtype=jnp.float32)
        if getattr(args, "adapter", None):  # a PEFT LoRA adapter on the base (retrojax.model.peft)
            from retrojax.model.lora import for_decoding
            from retrojax.model.peft import load_peft_adapter

            model = for_decoding(load_peft_adapter(model, args.adapter))
        tokenizer = load_tokenizer(tok_dir)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = reply(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, seed=args.seed)
    print(out.text)
    print(f"[{out.ids.size} tokens, finish: {out.finish_reason} ({out.reason})]", file=sys.stderr)
    return 0
