"""StarPO-S rollout filtering: keep the groups whose rewards vary most.

See docs/architecture.md, "Algorithms contract", and for the statistic and the group count
docs/architecture.md, "Deliberate differences from RAGEN".

A *group* is the set of trajectories that share an initial state (same seed). The filter ranks
groups by the unbiased std of their trajectory scores and keeps whole groups; the batch shrinks,
nothing is padded or refilled.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from decimal import ROUND_HALF_UP, Decimal

import torch

from ragen_core.algorithms._utils import as_float, check_finite, check_ndim, group_index, group_moments

__all__ = ["FILTER_MODES", "group_std_stats", "kept_group_count", "select_groups"]

FILTER_MODES = ("std", "std_rev")


def _scores_1d(scores: torch.Tensor) -> torch.Tensor:
    check_ndim("scores", scores, 1)
    scores = as_float(scores)
    check_finite(scores, "reward")
    return scores


def kept_group_count(ratio: float, n_groups: int) -> int:
    """How many of ``n_groups`` groups the filter keeps at ``ratio``: the one rounding rule.

        k = max(1, round_half_up(ratio · G))     (0.25·8 = 2, 0.5·5 = 3, 0.58·25 = 15)

    The product is taken in decimal, as the ratio is written (``0.58``), not in binary floating
    point, where 0.58·25 = 14.499999999999998 would round down. ``n_groups == 0`` keeps 0.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"rollout_filter_ratio must be in (0, 1], got {ratio}")
    if n_groups <= 0:
        return 0
    exact = Decimal(repr(float(ratio))) * n_groups
    return max(1, int(exact.to_integral_value(rounding=ROUND_HALF_UP)))


def select_groups(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    ratio: float,
    mode: str = "std",
) -> torch.Tensor:
    """StarPO-S uncertainty filter: a per-trajectory keep mask selecting whole groups.

        σ_g = unbiased std of {s_i : i ∈ g}
        k   = kept_group_count(ratio, G)        (G groups; max(1, round half up of ratio·G))
        keep the k groups with the largest σ_g ("std") or the smallest ("std_rev")

    Ties are broken by the order in which groups first appear in ``group_ids`` (earlier first), so
    the result is deterministic. ``ratio == 1`` keeps everything (any group size). A group of size
    1 with ratio < 1 raises ValueError (its std is undefined). An empty batch returns an empty mask.

    Args:
        scores: (N,) score of each trajectory (env reward + format penalty, before normalisation).
        group_ids: N group ids (tensor of ints or any hashables).
        ratio: fraction of groups to keep, in (0, 1].
        mode: "std" or "std_rev".
    Returns:
        (N,) bool keep mask.
    """
    if mode not in FILTER_MODES:
        raise ValueError(f"unknown rollout filter mode {mode!r}; valid modes: {', '.join(FILTER_MODES)}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"rollout_filter_ratio must be in (0, 1], got {ratio}")
    scores = _scores_1d(scores)
    index, n_groups = group_index(group_ids, scores.shape[0])
    keep_all = torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
    if ratio == 1.0 or n_groups == 0:
        return keep_all
    count, _, std = group_moments(scores, index, n_groups)
    if bool((count < 2).any()):
        raise ValueError(
            "group_size 1 has no in-group variance; use group_size >= 2 or rollout_filter_ratio=1"
        )
    n_keep = kept_group_count(ratio, n_groups)
    sign = -1.0 if mode == "std" else 1.0
    std_list = std.tolist()
    order = sorted(range(n_groups), key=lambda g: (sign * std_list[g], g))
    kept_groups = torch.zeros(n_groups, dtype=torch.bool)
    kept_groups[order[:n_keep]] = True
    return kept_groups[index].to(scores.device)


def group_std_stats(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> dict[str, float]:
    """Per-group score statistics for logging (RAGEN's ``rollout/in_group_*``).

    Returns floats:
        in_group_std       mean over groups of the unbiased in-group std
        in_group_std_max   largest group std
        in_group_std_min   smallest group std
        in_group_max       mean over groups of the group's best score
        in_group_mean      mean over groups of the group's mean score
    A group of size 1 counts as std 0 here (logging only); an empty batch gives all zeros.
    For the kept groups (``chosen_in_group_*``) call it on ``scores[keep]``.
    """
    scores = _scores_1d(scores)
    index, n_groups = group_index(group_ids, scores.shape[0])
    keys = ("in_group_std", "in_group_std_max", "in_group_std_min", "in_group_max", "in_group_mean")
    if n_groups == 0:
        return dict.fromkeys(keys, 0.0)
    _, mean, std = group_moments(scores, index, n_groups)
    std = torch.nan_to_num(std, nan=0.0)
    best = torch.full_like(mean, -math.inf).scatter_reduce(
        0, index.to(scores.device), scores, reduce="amax", include_self=True
    )
    values = (std.mean(), std.max(), std.min(), best.mean(), mean.mean())
    return {k: float(v) for k, v in zip(keys, values, strict=True)}
