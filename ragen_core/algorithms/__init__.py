"""RL algorithms for multi-turn LLM agents (RAGEN / StarPO): pure torch functions, no hidden state.

Every function takes tensors (token tensors are ``(B, T)`` with a ``mask`` of trained tokens, or
per-trajectory ``(N,)`` scores with group ids) and returns tensors; each docstring gives its
formula. Public contract: docs/architecture.md, "Algorithms contract".
"""

from ragen_core.algorithms.advantages import (
    bilevel_gae,
    gae,
    grpo,
    length_weight,
    reinforce_pp,
    rloo,
    soft_advantage_weights,
    turn_rewards_to_tokens,
    whiten,
)
from ragen_core.algorithms.filtering import FILTER_MODES, group_std_stats, kept_group_count, select_groups
from ragen_core.algorithms.losses import (
    AGG_MODES,
    KL_KINDS,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    policy_loss,
    value_loss,
)
from ragen_core.algorithms.normalization import NORM_GROUPINGS, NORM_METHODS, normalize_scores

__all__ = [
    "AGG_MODES",
    "FILTER_MODES",
    "KL_KINDS",
    "NORM_GROUPINGS",
    "NORM_METHODS",
    "agg_loss",
    "bilevel_gae",
    "entropy_from_logits",
    "gae",
    "group_std_stats",
    "grpo",
    "kept_group_count",
    "kl_penalty",
    "length_weight",
    "masked_mean",
    "normalize_scores",
    "policy_loss",
    "reinforce_pp",
    "rloo",
    "select_groups",
    "soft_advantage_weights",
    "turn_rewards_to_tokens",
    "value_loss",
    "whiten",
]
