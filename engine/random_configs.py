"""Named random-weight models (their shapes, as an HF config.json gives them)."""

from __future__ import annotations

from typing import Any

# Named random-weight models for the CLI and benchmarks; "bench" is every benchmark's default.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=704,
        vocab_size=8000,
    ),
    "bench": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1408,
        vocab_size=32000,
    ),
}
