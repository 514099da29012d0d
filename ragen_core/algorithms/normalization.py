"""Reward normalisation: trajectory scores rescaled within groups before any advantage is computed.

RAGEN-2's ``agent_proxy.reward_normalization`` (docs/architecture.md, "Learner step") rescales
each trajectory's score (environment reward + format penalty) within a grouping of the batch and
hands the result to the advantage estimator as the reward. The grouping decides which trajectories
share statistics; the learner maps it to group keys (docs/architecture.md, "Learner step"):

- ``state``: the trajectories of one initial state (the rollout's ``group_id``);
- ``inductive``: the trajectories of one environment tag (every state of that task together);
- ``batch``: the whole batch as one group.

The method is applied to each group on its own; ``normalize_scores`` documents the formulas.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ragen_core.algorithms._utils import as_float, check_finite, check_ndim, group_index, group_moments

__all__ = ["NORM_GROUPINGS", "NORM_METHODS", "normalize_scores"]

#: The groupings of ``learner.algorithm.reward_normalization.grouping``.
NORM_GROUPINGS = ("state", "batch", "inductive")
#: The methods of ``normalize_scores`` (``mean`` is in RAGEN-2's code, though not in its base.yaml comment).
NORM_METHODS = ("identity", "mean", "mean_std", "asym_clip")

#: asym_clip's bounds: a below-average trajectory is pushed down by at most 1 std, a better one up by 3.
ASYM_CLIP = (-1.0, 3.0)


@torch.no_grad()
def normalize_scores(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    method: str,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Scores normalised within their groups (RAGEN-2's reward normalisation).

    With mean_g and std_g the mean and unbiased std of the scores of group g:

        identity:   s'_i = s_i
        mean:       s'_i = s_i − mean_g
        mean_std:   s'_i = (s_i − mean_g) / (std_g + eps)   if std_g > eps, else 0
        asym_clip:  s'_i = clamp(mean_std(s)_i, −1, 3)

    A group of one has no std: ``mean_std`` and ``asym_clip`` give it 0, ``mean`` gives it 0 too
    (s − s). When *every* group has one member nothing is normalised (s' = s for every method),
    as in RAGEN-2, which only normalises when the groups are fewer than the trajectories.

    Args:
        scores: (N,) trajectory scores. group_ids: N group keys (ints or any hashables).
        method: one of :data:`NORM_METHODS`.
    Returns:
        (N,) normalised scores; empty input gives an empty result.
    """
    if method not in NORM_METHODS:
        raise ValueError(f"unknown normalisation method {method!r}; use one of {', '.join(NORM_METHODS)}")
    check_ndim("scores", scores, 1)
    scores = as_float(scores)
    check_finite(scores, "reward")
    index, n_groups = group_index(group_ids, scores.shape[0])
    if method == "identity" or n_groups == scores.shape[0]:
        return scores.clone()
    count, mean, std = group_moments(scores, index, n_groups)
    index = index.to(scores.device)
    centred = scores - mean[index]
    if method == "mean":
        return centred
    spread = std[index]
    varied = (count[index] > 1) & (spread > eps)  # NaN std (a group of one) compares False
    out = torch.where(varied, centred / (spread + eps), torch.zeros_like(centred))
    if method == "asym_clip":
        out = out.clamp(*ASYM_CLIP)
    return out
