"""Tiny random Hugging Face Qwen3 checkpoints made locally with transformers + torch (CPU), for tests.

``make_tiny_hf_checkpoint(tmp_path, **config_overrides)`` writes config.json + safetensors and returns the
directory. Norm weights are randomized (not all ones) so tests notice a norm applied in the wrong place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_HF_CONFIG: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
    "bos_token_id": None,
    "eos_token_id": None,
}


def make_tiny_hf_checkpoint(tmp_path: str | Path, *, seed: int = 0, layout: str = "v5",
                            max_shard_size: str | None = None, subdir: str = "hf-qwen3",
                            **config_overrides: Any) -> Path:
    """Create a random ``Qwen3ForCausalLM`` checkpoint under ``tmp_path/subdir`` and return that directory.

    layout: "v5" keeps transformers 5's ``rope_parameters``; "v4" rewrites config.json with a top-level
    ``rope_theta`` as transformers 4.x checkpoints (the released Qwen3 ones) have it.
    max_shard_size: e.g. "50KB" to force a sharded ``model.safetensors.index.json`` checkpoint.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if layout not in ("v4", "v5"):
        raise ValueError(f"layout must be 'v4' or 'v5', got {layout!r}")
    fields = {**TINY_HF_CONFIG, **config_overrides}
    rope_theta = float(fields.pop("rope_theta"))
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    config = transformers.Qwen3Config(**fields, rope_parameters=rope)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    out = Path(tmp_path) / subdir
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    if layout == "v4":
        cfg_path = out / "config.json"
        d = json.loads(cfg_path.read_text())
        d.pop("rope_parameters", None)
        d["rope_theta"] = rope_theta
        d["rope_scaling"] = None
        d["transformers_version"] = "4.51.0"
        cfg_path.write_text(json.dumps(d, indent=2))
    return out


def hf_logits(path: str | Path, input_ids, attention_mask=None, position_ids=None):
    """Float32 numpy logits of the transformers model stored at ``path`` (torch, CPU, eager attention)."""
    import numpy as np
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    kwargs = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
    if position_ids is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(position_ids), dtype=torch.long)
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long), **kwargs)
    return out.logits.float().numpy()
