"""StarPO-S rollout filtering: keep whole groups chosen by a group metric and a strategy (RAGEN-2).

See docs/architecture.md, "Algorithms contract", and for the statistic, the group count and the
strategies docs/architecture.md, "Deliberate differences from RAGEN".

A *group* is the set of trajectories that share an initial state (same seed). The filter computes one
value per group (``ragen_core.algorithms.filter_metrics``), chooses groups with a strategy and keeps
whole groups; the batch shrinks, nothing is padded or refilled. Every ranking breaks ties by the
order in which groups first appear (earlier first), so every result is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from ragen_core.algorithm_modes import kept_group_count
from ragen_core.algorithms._utils import as_float, check_finite, check_ndim, group_index, group_moments
from ragen_core.algorithms.filter_metrics import group_filter_metric

__all__ = [
    "FILTER_KEEP",
    "FILTER_STRATEGIES",
    "LOSS_SCALINGS",
    "TOP_P_MODES",
    "ZERO_TOL",
    "GroupSelection",
    "filter_loss_scale",
    "filter_rollouts",
    "group_std_stats",
    "kept_group_count",
    "min_p_groups",
    "select_by_value",
    "top_k_groups",
    "top_p_groups",
]

FILTER_STRATEGIES = ("top_p", "top_k", "top_k_abs", "min_p")
FILTER_KEEP = ("largest", "smallest")
TOP_P_MODES = ("linear", "softmax")
LOSS_SCALINGS = ("none", "linear", "sqrt")
#: |value| at or below this counts as zero (``include_zero=False`` drops such groups; RAGEN-2's 1e-10).
ZERO_TOL = 1e-10


def _scores_1d(scores: torch.Tensor) -> torch.Tensor:
    check_ndim("scores", scores, 1)
    scores = as_float(scores)
    check_finite(scores, "reward")
    return scores


def _check_keep(keep: str) -> None:
    if keep not in FILTER_KEEP:
        raise ValueError(f"unknown rollout filter keep {keep!r}; valid: {', '.join(FILTER_KEEP)}")


def _ranked(values: torch.Tensor, keep: str) -> list[int]:
    """Group indices best first: by value (descending for "largest"), ties by index."""
    _check_keep(keep)
    sign = -1.0 if keep == "largest" else 1.0
    listed = values.tolist()
    return sorted(range(len(listed)), key=lambda g: (sign * listed[g], g))


def _mask(n: int, chosen: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.bool)
    out[list(chosen)] = True
    return out


def top_k_groups(values: torch.Tensor, k: int, keep: str = "largest") -> torch.Tensor:
    """Top-k: keep the ``min(k, G)`` groups with the largest (``keep="smallest"``: smallest) value.

        keep g  iff  rank(v_g) < min(k, G)        (rank 0 = best; ties by first appearance)

    ``values`` (G,) are group values; returns a (G,) bool mask over the groups.
    """
    if k < 0:
        raise ValueError(f"top-k needs k >= 0, got {k}")
    return _mask(values.shape[0], _ranked(values, keep)[:k])


def top_p_groups(
    values: torch.Tensor, p: float, keep: str = "largest", mode: str = "linear", eps: float = 0.01
) -> torch.Tensor:
    """Top-p (nucleus) over groups: the best groups whose share of the total reaches ``p``.

    Groups are taken best first (v_(1), v_(2), ..., ties by first appearance); ``p >= 1`` keeps all.

        linear:   τ = p · Σ_g v_g − eps; take v_(1), v_(2), ... while Σ taken < τ, stopping before
                  the first v_(j) <= 0; keep the taken groups if Σ taken >= τ, else none
        softmax:  π = softmax(v) ("smallest": softmax(−v)); keep the smallest k with
                  Σ_{j<=k} π_(j) >= p (all groups if rounding leaves the total below p)

    ``linear`` needs non-negative values to mean "share of the total" (RAGEN-2's rule; a selection
    that cannot reach τ, e.g. all values 0 with ``eps=0`` or the first value <= 0, is empty).
    Computed in float64. Returns a (G,) bool mask over the groups.
    """
    if mode not in TOP_P_MODES:
        raise ValueError(f"unknown top-p mode {mode!r}; valid: {', '.join(TOP_P_MODES)}")
    if p <= 0.0:
        raise ValueError(f"top-p needs p > 0, got {p}")
    n = values.shape[0]
    if p >= 1.0 or n == 0:
        return torch.ones(n, dtype=torch.bool)
    v = values.detach().to(torch.float64).cpu()
    order = _ranked(v, keep)
    if mode == "softmax":
        probs = torch.softmax(v if keep == "largest" else -v, dim=0)
        cumulative = torch.cumsum(probs[order], dim=0)
        reached = torch.nonzero(cumulative >= p).flatten()
        k = int(reached[0]) + 1 if reached.numel() else n
        return _mask(n, order[:k])
    threshold = p * float(v.sum()) - eps
    taken, total = 0, 0.0
    for g in order:
        if total >= threshold or float(v[g]) <= 0.0:
            break
        total += float(v[g])
        taken += 1
    return _mask(n, order[:taken] if total >= threshold else [])


def min_p_groups(values: torch.Tensor, p: float, keep: str = "largest") -> torch.Tensor:
    """Min-p over groups: keep every group within a factor ``p`` of the best one.

        largest:   keep g  iff  v_g >= p · max_h v_h − 1e-10
        smallest:  keep g  iff  v_g <= min_h v_h / p + 1e-10

    (RAGEN-2's thresholds, ``0 < p <= 1``; RAGEN-2 also adds 1e-10 to the divisor p, a guard against
    p = 0 that is refused here instead. Meant for non-negative values: with a negative best value
    no group may pass.) Returns a (G,) bool mask over the groups; empty values give an empty mask.
    """
    _check_keep(keep)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"min-p needs p in (0, 1], got {p}")
    if values.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    v = values.detach().to(torch.float64).cpu()
    if keep == "largest":
        return v >= float(v.max()) * p - ZERO_TOL
    return v <= float(v.min()) / p + ZERO_TOL


def select_by_value(
    values: torch.Tensor,
    strategy: str,
    value: float,
    keep: str = "largest",
    include_zero: bool = True,
    top_p_mode: str = "linear",
    selection_eps: float = 0.01,
) -> torch.Tensor:
    """The groups a strategy keeps, given one value per group; a (G,) bool mask.

        candidates C = all groups, or with ``include_zero=False`` those with |v_g| > 1e-10
        top_p:      top_p_groups(v_C, p=value, keep, top_p_mode, selection_eps)
        top_k:      top_k_groups(v_C, kept_group_count(value, G), keep)    (value: fraction of all G)
        top_k_abs:  top_k_groups(v_C, max(1, int(value)), keep)            (value: a group count)
        min_p:      min_p_groups(v_C, p=value, keep)

    Groups outside C are never kept. ``top_p`` or ``top_k`` with ``value >= 1`` and
    ``include_zero`` keep every group without reading the values (so a spread metric of one-member
    groups, NaN, is fine there). Otherwise a NaN value raises ValueError. The result may be empty
    (top_p, min_p, or no candidate); callers decide what that means.
    """
    if strategy not in FILTER_STRATEGIES:
        raise ValueError(
            f"unknown rollout filter strategy {strategy!r}; valid: {', '.join(FILTER_STRATEGIES)}"
        )
    _check_keep(keep)
    check_ndim("values", values, 1)
    n_groups = values.shape[0]
    if include_zero and strategy in ("top_p", "top_k") and value >= 1.0:
        return torch.ones(n_groups, dtype=torch.bool)
    v = as_float(values).detach().to(torch.float64).cpu()
    if bool(torch.isnan(v).any()):
        raise ValueError(
            "a group's filter metric is undefined (NaN): an in-group spread needs two trajectories per "
            "group; use group_size >= 2 or a filter that keeps every group"
        )
    candidates = torch.arange(n_groups) if include_zero else torch.nonzero(v.abs() > ZERO_TOL).flatten()
    sub = v[candidates]
    if strategy == "top_p":
        chosen = top_p_groups(sub, value, keep, top_p_mode, selection_eps)
    elif strategy == "top_k":
        chosen = top_k_groups(sub, kept_group_count(value, n_groups), keep)
    elif strategy == "top_k_abs":
        chosen = top_k_groups(sub, max(1, int(value)), keep)
    else:
        chosen = min_p_groups(sub, value, keep)
    out = torch.zeros(n_groups, dtype=torch.bool)
    out[candidates[chosen]] = True
    return out


class GroupSelection(NamedTuple):
    """What :func:`filter_rollouts` decided: ``keep`` (N,) per trajectory, ``group_values`` (G,) the
    metric of each group and ``kept_groups`` (G,) bool, groups numbered by first appearance."""

    keep: torch.Tensor
    group_values: torch.Tensor
    kept_groups: torch.Tensor


def filter_rollouts(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    strategy: str,
    value: float,
    metric: str = "reward_variance",
    keep: str = "largest",
    include_zero: bool = True,
    top_p_mode: str = "linear",
    selection_eps: float = 0.01,
    logprobs: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> GroupSelection:
    """The rollout filter: the group metric, then the strategy, then whole groups.

        v_g  = group_filter_metric(metric, scores, group_ids, logprobs, mask)
        K    = select_by_value(v, strategy, value, keep, include_zero, top_p_mode, selection_eps)
        keep trajectory i  iff  its group is in K

    With ``strategy="top_k", metric="reward_variance", keep="largest", include_zero=True`` (the
    defaults of ``rollout.filter``) this is the paper's StarPO-S filter: the ``kept_group_count(value,
    G)`` groups with the largest unbiased in-group score std. An empty batch keeps nothing.

    The arguments are the keys of ``rollout.filter`` under the same names.
    """
    scores = _scores_1d(scores)
    index, n_groups = group_index(group_ids, scores.shape[0])
    if n_groups == 0:
        empty = torch.zeros(0, dtype=torch.bool, device=scores.device)
        return GroupSelection(empty, torch.zeros(0, dtype=scores.dtype), torch.zeros(0, dtype=torch.bool))
    values = group_filter_metric(metric, scores, group_ids, logprobs, mask)
    kept_groups = select_by_value(values, strategy, value, keep, include_zero, top_p_mode, selection_eps)
    return GroupSelection(kept_groups[index].to(scores.device), values, kept_groups)


def filter_loss_scale(kept_groups: int, n_groups: int, mode: str) -> float:
    """RAGEN-2's ``filter_loss_scaling``: the factor the advantages are multiplied by after a filter.

        r = kept_groups / n_groups;   none: 1;   linear: r;   sqrt: √r

    (1 for an empty batch.) Scaling the advantages scales the policy-gradient loss by the same
    factor; the critic's returns are not scaled.
    """
    if mode not in LOSS_SCALINGS:
        raise ValueError(f"unknown filter loss scaling {mode!r}; valid: {', '.join(LOSS_SCALINGS)}")
    if mode == "none" or n_groups <= 0:
        return 1.0
    ratio = kept_groups / n_groups
    return ratio if mode == "linear" else math.sqrt(ratio)


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
