"""Group-level statistics the rollout filter ranks groups by (RAGEN-2's ``rollout_filter_metric``).

A *group* is the set of trajectories that share an initial state (same seed). Each metric reduces
a per-trajectory quantity to one value per group; groups are numbered by first appearance in
``group_ids`` (as everywhere in ``ragen_core.algorithms``). See docs/architecture.md, "Algorithms
contract", and for how the entropy is estimated "Deliberate differences from RAGEN".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ragen_core.algorithm_modes import FILTER_METRICS, SPREAD_FILTER_METRICS, TOKEN_FILTER_METRICS
from ragen_core.algorithms._utils import (
    as_float,
    check_finite,
    check_ndim,
    check_same_shape,
    group_index,
    group_moments,
)

__all__ = [
    "FILTER_METRICS",
    "SPREAD_FILTER_METRICS",
    "TOKEN_FILTER_METRICS",
    "group_filter_metric",
    "group_mean",
    "group_std",
    "group_sum",
    "response_lengths",
    "sampled_token_entropy",
]


def _values_1d(values: torch.Tensor, what: str) -> torch.Tensor:
    check_ndim(what, values, 1)
    values = as_float(values)
    check_finite(values, what)
    return values


def group_sum(values: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """Per-group sum, ``(G,)``:  S_g = Σ_{i∈g} x_i."""
    values = _values_1d(values, "values")
    index, n_groups = group_index(group_ids, values.shape[0])
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index.to(values.device), values
    )


def _group_count(values: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    return group_sum(torch.ones_like(values), group_ids)


def group_mean(values: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """Per-group mean, ``(G,)``:  μ_g = S_g / n_g."""
    return group_sum(values, group_ids) / _group_count(as_float(values), group_ids)


def group_std(values: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """Per-group unbiased std, ``(G,)``:  σ_g = sqrt(Σ_{i∈g} (x_i − μ_g)² / (n_g − 1)); NaN when n_g = 1.

    The mean is subtracted before squaring (two passes), so σ_g of equal values is exactly 0.
    """
    values = _values_1d(values, "values")
    index, n_groups = group_index(group_ids, values.shape[0])
    return group_moments(values, index, n_groups)[2]


def response_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Tokens the policy sampled per trajectory, ``(B,)``:  ℓ_i = Σ_t m_it."""
    check_ndim("mask", mask, 2)
    return (mask != 0).sum(dim=1).to(torch.get_default_dtype())


def sampled_token_entropy(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-trajectory entropy estimated from the sampled tokens, ``(B,)``:

        Ĥ_i = −Σ_t m_it · log π(a_it) / max(1, Σ_t m_it)

    ``logprobs`` are the log-probs of the tokens that were sampled (the trajectory table's
    ``rollout_logprobs``), not the full next-token distributions, so this is the Monte-Carlo estimate
    of the mean per-token entropy: E_{a~π}[−log π(a)] = H(π) for each token. It is unbiased when the
    tokens were sampled from π itself (temperature 1, no top-p / top-k truncation); otherwise it is a
    cross-entropy. RAGEN-2 instead averages the exact per-token entropy of the full distribution,
    which needs a forward pass of the policy. A trajectory without sampled tokens gets 0.
    """
    check_ndim("logprobs", logprobs, 2)
    check_same_shape(logprobs=logprobs, mask=mask)
    logprobs = as_float(logprobs)
    on = mask != 0
    check_finite(logprobs, "log-prob", where=on)
    total = torch.where(on, -logprobs, torch.zeros_like(logprobs)).sum(dim=1)
    return total / on.sum(dim=1).clamp(min=1).to(total.dtype)


def group_filter_metric(
    metric: str,
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The value of ``metric`` for each group, ``(G,)`` (RAGEN-2's group-level definitions):

        reward_variance    σ_g of the scores s_i (the unbiased std, StarPO-S's uncertainty; NaN if n_g = 1)
        reward             μ_g of the scores
        reward_sum         S_g of the scores
        entropy            μ_g of Ĥ_i (``sampled_token_entropy``)
        entropy_variance   σ_g of Ĥ_i (NaN if n_g = 1)
        length             μ_g of ℓ_i (``response_lengths``)

    ``scores`` (N,) are the trajectory scores (env reward + format penalty); ``logprobs`` and
    ``mask`` (N, T) are needed by the entropy and length metrics only. "variance" is RAGEN-2's name;
    the statistic is a standard deviation, as there.
    """
    if metric not in FILTER_METRICS:
        raise ValueError(
            f"unknown rollout filter metric {metric!r}; valid metrics: {', '.join(FILTER_METRICS)}"
        )
    scores = _values_1d(scores, "reward")
    if metric == "reward_variance":
        return group_std(scores, group_ids)
    if metric == "reward":
        return group_mean(scores, group_ids)
    if metric == "reward_sum":
        return group_sum(scores, group_ids)
    if mask is None or (metric != "length" and logprobs is None):
        raise ValueError(f"rollout filter metric {metric!r} needs the token log-probs and loss mask")
    if mask.shape[0] != scores.shape[0]:
        raise ValueError(f"shape mismatch: scores {tuple(scores.shape)}, mask {tuple(mask.shape)}")
    if metric == "length":
        return group_mean(response_lengths(mask).to(scores.dtype), group_ids)
    assert logprobs is not None
    entropy = sampled_token_entropy(logprobs, mask).to(scores.dtype)
    return group_mean(entropy, group_ids) if metric == "entropy" else group_std(entropy, group_ids)
