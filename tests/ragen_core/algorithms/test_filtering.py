"""RAGEN-2's rollout-filter family: group metrics and strategies against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_core.algorithms import (
    filter_loss_scale,
    filter_rollouts,
    group_filter_metric,
    kept_group_count,
    min_p_groups,
    response_lengths,
    sampled_token_entropy,
    select_by_value,
    top_k_groups,
    top_p_groups,
)


def t64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ----------------------------------------------------------------------------- metrics

# 3 groups of 2, interleaved ids (first appearance: 7, 3, 5)
GROUPS = [7, 3, 5, 7, 3, 5]
SCORES = t64([1.0, 0.0, 2.0, 3.0, 0.0, -1.0])


def test_reward_metrics_by_hand() -> None:
    # group 7: {1, 3}  mean 2, sum 4, std sqrt(2); group 3: {0, 0}: 0, 0, 0; group 5: {2, -1}: 0.5, 1, sqrt(4.5)
    std = group_filter_metric("reward_variance", SCORES, GROUPS)
    assert std.tolist() == pytest.approx([math.sqrt(2), 0.0, math.sqrt(4.5)])
    assert group_filter_metric("reward", SCORES, GROUPS).tolist() == pytest.approx([2.0, 0.0, 0.5])
    assert group_filter_metric("reward_sum", SCORES, GROUPS).tolist() == pytest.approx([4.0, 0.0, 1.0])
    assert torch.isnan(group_filter_metric("reward_variance", t64([1.0, 2.0]), [0, 1])).all()
    with pytest.raises(ValueError, match="valid metrics: reward_variance"):
        group_filter_metric("variance", SCORES, GROUPS)
    with pytest.raises(ValueError, match="needs the token log-probs"):
        group_filter_metric("entropy", SCORES, GROUPS)


def test_token_metrics_by_hand() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    logp = t64([[9.0, -1.0, -3.0, 0.0], [0.0, -0.5, 7.0, 0.0], [0.0, -1.0, -1.0, -4.0], [0.0] * 4])
    # lengths 2, 1, 3, 0; entropy estimates (1+3)/2 = 2, 0.5, (1+1+4)/3 = 2, 0 (no token)
    assert response_lengths(mask).tolist() == [2.0, 1.0, 3.0, 0.0]
    assert sampled_token_entropy(logp, mask).tolist() == pytest.approx([2.0, 0.5, 2.0, 0.0])
    groups = [0, 1, 0, 1]  # group 0: rows 0, 2; group 1: rows 1, 3
    scores = torch.zeros(4)
    assert group_filter_metric("length", scores, groups, mask=mask).tolist() == [2.5, 0.5]
    assert group_filter_metric("entropy", scores, groups, logp, mask).tolist() == pytest.approx([2.0, 0.25])
    ent_std = group_filter_metric("entropy_variance", scores, groups, logp, mask)
    assert ent_std.tolist() == pytest.approx([0.0, math.sqrt(0.125)])
    with pytest.raises(ValueError, match="non-finite log-prob"):
        sampled_token_entropy(t64([[0.0, float("-inf")]]), torch.tensor([[0, 1]]))
    # outside the mask a non-finite value is ignored
    assert sampled_token_entropy(t64([[float("nan"), -2.0]]), torch.tensor([[0, 1]])).tolist() == [2.0]


# ----------------------------------------------------------------------------- strategies


def test_top_k_ties_by_first_appearance() -> None:
    v = t64([1.0, 3.0, 3.0, 0.0, 3.0])
    assert top_k_groups(v, 2).tolist() == [False, True, True, False, False]
    assert top_k_groups(v, 2, "smallest").tolist() == [True, False, False, True, False]
    assert top_k_groups(v, 9).all() and not top_k_groups(v, 0).any()
    with pytest.raises(ValueError, match="largest, smallest"):
        top_k_groups(v, 1, "max")


def test_top_p_linear_by_hand() -> None:
    v = t64([1.0, 4.0, 3.0, 2.0])  # sum 10
    # p = 0.5: tau = 5 - 0.01 = 4.99; take 4 (4 < 4.99), then 3 (7 >= 4.99): groups 1, 2
    assert top_p_groups(v, 0.5).tolist() == [False, True, True, False]
    # p = 0.4: tau = 3.99; 4 alone reaches it
    assert top_p_groups(v, 0.4).tolist() == [False, True, False, False]
    # eps = 0, p = 0.4: tau = 4 is reached by 4 exactly
    assert top_p_groups(v, 0.4, eps=0.0).tolist() == [False, True, False, False]
    # smallest first: 1, 2 (3 < 4.99), 3 (6 >= 4.99): groups 0, 3, 2
    assert top_p_groups(v, 0.5, "smallest").tolist() == [True, False, True, True]
    # ties: the earlier group is taken first
    assert top_p_groups(t64([2.0, 2.0, 0.0]), 0.4).tolist() == [True, False, False]
    # a non-positive value stops the sum; if tau is not reached then, nothing is kept
    assert not top_p_groups(t64([1.0, 0.0, 0.0, 3.0]), 0.5, "smallest").any()
    # all zero with eps > 0: tau = -eps is reached by nothing taken: empty (RAGEN-2's rule)
    assert not top_p_groups(torch.zeros(3, dtype=torch.float64), 0.9).any()
    assert top_p_groups(v, 1.0).all()


def test_top_p_softmax_by_hand() -> None:
    v = t64([0.0, math.log(3.0), 0.0, math.log(4.0)])  # softmax = [1, 3, 1, 4] / 9
    # sorted: 4/9 (0.444), +3/9 (0.778), +1/9 (0.889), +1/9
    assert top_p_groups(v, 0.4, mode="softmax").tolist() == [False, False, False, True]
    assert top_p_groups(v, 0.7, mode="softmax").tolist() == [False, True, False, True]
    # 0.85: needs one of the tied 1/9 groups: the first (group 0)
    assert top_p_groups(v, 0.85, mode="softmax").tolist() == [True, True, False, True]
    # smallest: softmax(-v) = [1, 1/3, 1, 1/4] / (2 + 7/12) = [12, 4, 12, 3] / 31: 12/31 = 0.387
    assert top_p_groups(v, 0.3, "smallest", mode="softmax").tolist() == [True, False, False, False]
    assert top_p_groups(v, 0.5, "smallest", mode="softmax").tolist() == [True, False, True, False]
    with pytest.raises(ValueError, match="linear, softmax"):
        top_p_groups(v, 0.5, mode="nucleus")


def test_min_p_by_hand() -> None:
    v = t64([4.0, 3.0, 2.0, 1.0])
    assert min_p_groups(v, 0.5).tolist() == [True, True, True, False]  # >= 2
    assert min_p_groups(v, 0.8).tolist() == [True, False, False, False]  # >= 3.2
    assert min_p_groups(v, 0.5, "smallest").tolist() == [False, False, True, True]  # <= 1 / 0.5 = 2
    assert min_p_groups(v, 1.0, "smallest").tolist() == [False, False, False, True]
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        min_p_groups(v, 0.0)


def test_select_by_value_candidates_and_counts() -> None:
    v = t64([0.0, 2.0, 0.0, 1.0, 3.0])
    # top_k counts a fraction of all groups: 0.4 x 5 = 2
    assert select_by_value(v, "top_k", 0.4).tolist() == [False, True, False, False, True]
    # without zeros, smallest picks among the non-zero groups only
    assert select_by_value(v, "top_k", 0.4, "smallest").tolist() == [True, False, True, False, False]
    assert select_by_value(v, "top_k", 0.4, "smallest", include_zero=False).tolist() == [
        False,
        True,
        False,
        True,
        False,
    ]
    # top_k with more than the candidates keeps the candidates
    assert select_by_value(v, "top_k", 1.0, include_zero=False).tolist() == [False, True, False, True, True]
    assert select_by_value(v, "top_k_abs", 1).tolist() == [False, False, False, False, True]
    assert select_by_value(v, "top_k_abs", 10, include_zero=False).sum() == 3
    assert select_by_value(v, "min_p", 0.5).tolist() == [False, True, False, False, True]  # >= 1.5
    # linear top_p over the candidates: sum 6, tau 0.5 x 6 - 0.01: 3 (< 2.99? no: 3 >= 2.99)
    assert select_by_value(v, "top_p", 0.5, include_zero=False).tolist() == [False, False, False, False, True]
    # every value zero and zeros excluded: nothing
    assert not select_by_value(torch.zeros(3), "top_k", 0.5, include_zero=False).any()
    # a filter that keeps everything does not read the values (NaN of a group of one is fine)
    nan = t64([float("nan"), 1.0])
    assert select_by_value(nan, "top_p", 1.0).all() and select_by_value(nan, "top_k", 1.0).all()
    with pytest.raises(ValueError, match="undefined"):
        select_by_value(nan, "top_k", 0.5)
    with pytest.raises(ValueError, match="top_p, top_k, top_k_abs, min_p"):
        select_by_value(v, "bottom_k", 0.5)


def test_filter_rollouts_whole_groups_and_the_std_filter() -> None:
    sel = filter_rollouts(SCORES, GROUPS, "top_k", 0.5)  # 0.5 x 3 = 1.5 -> 2 groups: 5 (2.12), 7 (1.41)
    assert sel.kept_groups.tolist() == [True, False, True]
    assert sel.keep.tolist() == [True, False, True, True, False, True]
    assert sel.group_values.tolist() == pytest.approx([math.sqrt(2), 0.0, math.sqrt(4.5)])
    reward = filter_rollouts(SCORES, GROUPS, "top_k_abs", 1, metric="reward")
    assert reward.keep.tolist() == [True, False, False, True, False, False]
    empty = filter_rollouts(torch.zeros(0), [], "top_p", 0.5)
    assert empty.keep.shape == (0,) and empty.kept_groups.shape == (0,)
    # top_k on reward_variance keeps the kept_group_count groups of largest (smallest) unbiased std,
    # ties by first appearance, for any value
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (40,), generator=gen).double()
    groups = [g for g in range(10) for _ in range(4)]
    std = scores.reshape(10, 4).std(dim=1).tolist()
    for value in (0.1, 0.25, 0.5, 0.55, 1.0):
        for keep, sign in (("largest", -1.0), ("smallest", 1.0)):
            best = sorted(range(10), key=lambda g: (sign * std[g], g))[: kept_group_count(value, 10)]
            new = filter_rollouts(scores, groups, "top_k", value, keep=keep).keep
            assert new.tolist() == [g in best for g in groups], (value, keep)


def test_filter_loss_scale() -> None:
    assert filter_loss_scale(2, 8, "none") == 1.0
    assert filter_loss_scale(2, 8, "linear") == 0.25
    assert filter_loss_scale(2, 8, "sqrt") == 0.5
    assert filter_loss_scale(0, 0, "linear") == 1.0
    with pytest.raises(ValueError, match="none, linear, sqrt"):
        filter_loss_scale(1, 2, "log")
