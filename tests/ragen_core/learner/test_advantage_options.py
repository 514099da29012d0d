"""RAGEN-2's reward normalisation and advantage options as pure functions, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from ragen_core.algorithms import (
    NORM_METHODS,
    length_weight,
    normalize_scores,
    soft_advantage_weights,
    turn_rewards_to_tokens,
)

F64 = torch.float64
EPS = 1e-6


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


# ------------------------------------------------------------------------------ reward normalisation

#: group a: mean 2, unbiased std sqrt(2); group b: no spread; group c: a single trajectory
SCORES = [1.0, 3.0, 0.0, 0.0, 5.0]
GROUPS = ["a", "a", "b", "b", "c"]


def test_mean_std_hand_values():
    z = 1 / (math.sqrt(2) + EPS)
    out = normalize_scores(t64(SCORES), GROUPS, "mean_std")
    torch.testing.assert_close(out, t64([-z, z, 0.0, 0.0, 0.0]))


def test_mean_and_identity_hand_values():
    torch.testing.assert_close(normalize_scores(t64(SCORES), GROUPS, "mean"), t64([-1.0, 1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(normalize_scores(t64(SCORES), GROUPS, "identity"), t64(SCORES))


def test_asym_clip_clamps_to_minus_one_and_three():
    # 15 zeros and a one: mean 1/16, unbiased std 1/4, so z(1) = 3.75 -> 3 and z(0) = -0.25;
    # the mirror group (15 ones, a zero) has z(0) = -3.75 -> -1 and z(1) = 0.25.
    up = [0.0] * 15 + [1.0]
    down = [1.0] * 15 + [0.0]
    out = normalize_scores(t64(up + down), [0] * 16 + [1] * 16, "asym_clip")
    small = (1 / 16) / (0.25 + EPS)  # = 0.25 up to eps
    expected = t64([-small] * 15 + [3.0] + [small] * 15 + [-1.0])
    torch.testing.assert_close(out, expected)
    # mean_std alone does not clip
    plain = normalize_scores(t64(up), [0] * 16, "mean_std")
    assert plain[-1].item() == pytest.approx(0.9375 / (0.25 + EPS))


def test_groupings_are_just_group_keys():
    scores = t64([1.0, 3.0, 2.0, 6.0])
    # batch: one group (mean 3, unbiased std sqrt((4 + 0 + 1 + 9) / 3))
    std = math.sqrt(14 / 3)
    batch = normalize_scores(scores, [0, 0, 0, 0], "mean_std")
    torch.testing.assert_close(batch, t64([-2 / (std + EPS), 0.0, -1 / (std + EPS), 3 / (std + EPS)]))
    # inductive: environment tags as keys (group "Bandit": 1, 2; group "Sokoban": 3, 6)
    tags = ["Bandit", "Sokoban", "Bandit", "Sokoban"]
    torch.testing.assert_close(normalize_scores(scores, tags, "mean"), t64([-0.5, -1.5, 0.5, 1.5]))


def test_all_groups_of_one_are_left_as_they_are():
    # RAGEN-2 normalises only when there are fewer groups than trajectories
    scores = t64([1.0, -2.0, 7.0])
    for method in NORM_METHODS:
        torch.testing.assert_close(normalize_scores(scores, [0, 1, 2], method), scores)


def test_normalisation_validation_and_empty():
    with pytest.raises(ValueError, match="unknown normalisation method 'z_score'"):
        normalize_scores(t64([1.0, 2.0]), [0, 0], "z_score")
    with pytest.raises(ValueError, match=r"non-finite reward in trajectories \[1\]"):
        normalize_scores(t64([1.0, float("inf")]), [0, 0], "mean_std")
    with pytest.raises(ValueError, match="shape mismatch"):
        normalize_scores(t64([1.0, 2.0]), [0], "mean")
    assert normalize_scores(torch.zeros(0), [], "mean_std").shape == (0,)


def test_identity_returns_a_copy():
    scores = t64([1.0, 2.0])
    out = normalize_scores(scores, [0, 0], "identity")
    out[0] = 9.0
    assert scores[0].item() == 1.0


# ------------------------------------------------------------------------------ turn scores on tokens


def test_turn_rewards_go_on_each_turns_last_masked_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0]])
    turns = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]])
    rewards = t64([[0.5, -0.1], [2.0, 0.0]])  # row 1 has one turn (padded with 0)
    out = turn_rewards_to_tokens(rewards, mask, turns)
    expected = t64([[0, 0, 0.5, 0, 0, -0.1], [0, 0, 0, 2.0, 0, 0]])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out.sum(dim=1), rewards.sum(dim=1))


def test_turn_rewards_of_absent_turns_raise():
    mask = torch.tensor([[0, 1, 1]])
    turns = torch.tensor([[0, 0, 0]])
    with pytest.raises(ValueError, match="non-zero for turns that have no masked token"):
        turn_rewards_to_tokens(t64([[1.0, 2.0]]), mask, turns)
    with pytest.raises(ValueError, match="same batch size"):
        turn_rewards_to_tokens(t64([[1.0], [2.0]]), mask, turns)
    with pytest.raises(ValueError, match="non-decreasing"):
        turn_rewards_to_tokens(t64([[1.0, 2.0]]), mask, torch.tensor([[0, 1, 0]]))


# ------------------------------------------------------------------------------ soft reweighting


def test_soft_weights_are_group_std_over_the_largest():
    # stds: group 0 sqrt(0.5), group 1 0, group 2 sqrt(2); group 3 has one member (std := 0)
    scores = t64([0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 100.0])
    groups = [0, 0, 1, 1, 2, 2, 3]
    top = math.sqrt(2) + EPS
    w0, w2 = math.sqrt(0.5) / top, math.sqrt(2) / top
    torch.testing.assert_close(soft_advantage_weights(scores, groups), t64([w0, w0, 0, 0, w2, w2, 0]))


def test_soft_weights_without_spread_are_zero_and_empty_is_empty():
    assert (soft_advantage_weights(t64([1.0, 1.0, 3.0, 3.0]), [0, 0, 1, 1]) == 0).all()
    assert soft_advantage_weights(torch.zeros(0), []).shape == (0,)


# ------------------------------------------------------------------------------ length weighting


def test_length_weight_divides_by_the_relative_length():
    # trained lengths 2 and 6, mean 4: row 0 is scaled by 4 / 2, row 1 by 4 / 6
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    adv = t64([[1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.3] * 6])
    out = length_weight(adv, mask)
    expected = t64([[4 / (2 + EPS)] * 2 + [0.0] * 4, [0.3 * 4 / (6 + EPS)] * 6])
    torch.testing.assert_close(out, expected)


def test_length_weight_is_zero_outside_the_mask_and_checks_shapes():
    mask = torch.tensor([[1, 0], [1, 1]])
    out = length_weight(t64([[1.0, 5.0], [1.0, 1.0]]), mask)
    assert out[0, 1].item() == 0.0
    with pytest.raises(ValueError, match="shape mismatch"):
        length_weight(t64([[1.0, 2.0]]), torch.ones(1, 3))
    assert length_weight(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 3)
