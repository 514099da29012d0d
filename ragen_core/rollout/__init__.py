"""Rollout engines: token ids in, sampled token ids and their log-probs out."""

from ragen_core.rollout.engine import (
    Generation,
    PromptTooLongError,
    RolloutEngine,
    SamplingParams,
)
from ragen_core.rollout.hf_engine import HFEngine

__all__ = ["Generation", "HFEngine", "PromptTooLongError", "RolloutEngine", "SamplingParams"]
