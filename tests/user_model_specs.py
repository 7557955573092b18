"""The example package's models and a tiny Hugging Face Llama as job-spec sections,
shared by the tests that train them under every strategy."""

from typing import Any

HF_WIDTHS: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""A tiny Hugging Face decoder's sizes, for any family's config (grouped-query attention:
4 query heads over 2 key/value heads)."""

MODELS: dict[str, dict[str, Any]] = {
    "cnn": {
        "model": {"kind": "custom", "target": "user_models.cnn:build", "args": {"width": 8}},
        "task": {"kind": "classify"},
        "data": {"kind": "clusters", "num_classes": 10, "shape": [1, 8, 8], "eval_samples": 32},
    },
    "transformer": {
        "model": {
            "kind": "custom",
            "target": "user_models.transformer:TinyTransformer",
            "args": {"vocab_size": 16, "width": 32, "depth": 2, "heads": 2, "block_size": 16},
            "block_size": 16,
        },
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
    },
    "llama": {
        "model": {
            "kind": "hf",
            "hf": {
                "model_type": "llama",
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
            },
            "block_size": 16,
        },
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
    },
}
"""Model name -> the `model`, `task` and `data` sections that train it."""
