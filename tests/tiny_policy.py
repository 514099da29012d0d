"""The smallest tiny policy the tests build (one layer, 32 wide): for tests that need a real model that
plays and a tokenizer, not one that plays well."""

from __future__ import annotations

from typing import Any


def smallest_policy() -> tuple[Any, Any]:
    """(model, tokenizer), the same every call (seeded)."""
    from ragen_core.config.model import ModelConfig
    from ragen_core.models.policies import build_tiny_policy

    return build_tiny_policy(
        ModelConfig(
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            corpus_seeds=2,
            seed=1,
        )
    )
