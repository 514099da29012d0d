"""Rollout engines: token ids in, sampled token ids and their log-probs out."""

from ragen_core.rollout.engine import (
    Generation,
    HFEngine,
    PromptTooLongError,
    RolloutEngine,
    SamplingParams,
)

__all__ = ["Generation", "HFEngine", "PromptTooLongError", "RolloutEngine", "SamplingParams"]
