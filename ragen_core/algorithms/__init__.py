"""RL algorithms for multi-turn LLM agents (RAGEN / StarPO): pure torch functions, no hidden state.

Every function takes tensors (token tensors are ``(B, T)`` with a ``mask`` of trained tokens, or
per-trajectory ``(N,)`` scores with group ids) and returns tensors; each docstring gives its
formula. Public contract: docs/architecture.md, "Algorithms contract".

The tensor functions load torch, so this package imports them on first use (``__getattr__``): the
config reads the names in ``registry`` (the advantage estimators and policy losses) without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ragen_core.algorithms.registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossInputs,
    register_adv_estimator,
    register_policy_loss,
)

if TYPE_CHECKING:
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
    from ragen_core.algorithms.constrained import restrict_to_allowed
    from ragen_core.algorithms.filter_metrics import (
        FILTER_METRICS,
        SPREAD_FILTER_METRICS,
        TOKEN_FILTER_METRICS,
        group_filter_metric,
        group_mean,
        group_std,
        group_sum,
        response_lengths,
        sampled_token_entropy,
    )
    from ragen_core.algorithms.filtering import (
        FILTER_KEEP,
        FILTER_STRATEGIES,
        LOSS_SCALINGS,
        TOP_P_MODES,
        ZERO_TOL,
        GroupSelection,
        filter_loss_scale,
        filter_rollouts,
        group_std_stats,
        kept_group_count,
        min_p_groups,
        select_by_value,
        top_k_groups,
        top_p_groups,
    )
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

#: The modules of the tensor functions, imported when one of their names is first read.
_TENSOR_MODULES = ("advantages", "constrained", "filter_metrics", "filtering", "losses", "normalization")

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "FILTER_KEEP",
    "FILTER_METRICS",
    "FILTER_STRATEGIES",
    "KL_KINDS",
    "LOSS_SCALINGS",
    "NORM_GROUPINGS",
    "NORM_METHODS",
    "POLICY_LOSSES",
    "SPREAD_FILTER_METRICS",
    "TOKEN_FILTER_METRICS",
    "TOP_P_MODES",
    "ZERO_TOL",
    "AdvantageInputs",
    "GroupSelection",
    "PolicyLossInputs",
    "agg_loss",
    "bilevel_gae",
    "entropy_from_logits",
    "filter_loss_scale",
    "filter_rollouts",
    "gae",
    "group_filter_metric",
    "group_mean",
    "group_std",
    "group_std_stats",
    "group_sum",
    "grpo",
    "kept_group_count",
    "kl_penalty",
    "length_weight",
    "masked_mean",
    "min_p_groups",
    "normalize_scores",
    "policy_loss",
    "register_adv_estimator",
    "register_policy_loss",
    "reinforce_pp",
    "response_lengths",
    "restrict_to_allowed",
    "rloo",
    "sampled_token_entropy",
    "select_by_value",
    "soft_advantage_weights",
    "top_k_groups",
    "top_p_groups",
    "turn_rewards_to_tokens",
    "value_loss",
    "whiten",
]


def __getattr__(name: str) -> object:
    if name in __all__:
        for sub in _TENSOR_MODULES:
            module = importlib.import_module(f"{__name__}.{sub}")
            if hasattr(module, name):
                value = getattr(module, name)
                globals()[name] = value  # the next read is a plain attribute
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
