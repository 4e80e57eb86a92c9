"""The Qwen3 policy: model, Hugging Face checkpoints, tokenizer and chat format."""

from retrojax.model.checkpoint import (
    DEFAULT_RULES,
    CheckpointError,
    from_pretrained,
    param_shardings,
    partition_spec,
    save_pretrained,
    shard_model,
)
from retrojax.model.qwen3 import (
    PRESETS,
    KVCache,
    Qwen3,
    Qwen3Config,
    count_params,
    init_cache,
    token_logprobs,
)
from retrojax.model.tokenizer import (
    CHAT_SPECIAL_TOKENS,
    ChatTokenizer,
    load_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "CHAT_SPECIAL_TOKENS",
    "ChatTokenizer",
    "load_tokenizer",
    "train_sentencepiece",
    "DEFAULT_RULES",
    "CheckpointError",
    "from_pretrained",
    "param_shardings",
    "partition_spec",
    "save_pretrained",
    "shard_model",
    "PRESETS",
    "KVCache",
    "Qwen3",
    "Qwen3Config",
    "count_params",
    "init_cache",
    "token_logprobs",
]
