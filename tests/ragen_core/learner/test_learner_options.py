"""Learner.step with RAGEN-2's reward normalisation and advantage options: what each changes, against
hand-computed values read from the step's metrics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ragen_core.config.learner import RewardNormalizationConfig
from ragen_core.learner.batch import BadBatchError, TokenBatch
from ragen_core.learner.update import Learner
from tests.ragen_core.learner.test_learner import make_cfg, max_diff, random_batch, tiny_policy, weights

pytestmark = pytest.mark.usefixtures("one_thread")

EPS = 1e-6
#: two groups of four (random_batch's group_ids): group 0 mean 1, std sqrt(2); group 1 mean 3, std 2
SCORES = [1.0, 3.0, 0.0, 0.0, 2.0, 2.0, 2.0, 6.0]


def batch_with(scores: list[float], **fields: object) -> TokenBatch:
    return dataclasses.replace(random_batch(8, seed=5), scores=torch.tensor(scores), **fields)


def step(batch: TokenBatch, **algorithm: object) -> dict[str, float]:
    return Learner(tiny_policy(), make_cfg(**algorithm)).step(batch)


def norm(grouping: str, method: str) -> RewardNormalizationConfig:
    return RewardNormalizationConfig(grouping=grouping, method=method)


def test_state_normalisation_rescales_the_rewards_not_the_reported_scores():
    m = step(batch_with(SCORES), reward_normalization=norm("state", "mean_std"))
    # group 1's 6 -> (6 - 3) / 2 = 1.5; group 0's 0 -> (0 - 1) / sqrt(2); each group sums to 0
    assert m["critic/rewards/max"] == pytest.approx(3 / (2 + EPS), rel=1e-6)
    assert m["critic/rewards/min"] == pytest.approx(-1 / (math.sqrt(2) + EPS), rel=1e-6)
    assert m["critic/rewards/mean"] == pytest.approx(0.0, abs=1e-6)
    assert (m["critic/score/max"], m["critic/score/min"]) == (6.0, 0.0)  # the scores as played


def test_batch_and_inductive_groupings():
    m = step(batch_with(SCORES), reward_normalization=norm("batch", "mean_std"))
    # the whole batch: mean 2, unbiased std sqrt(26 / 7)
    assert m["critic/rewards/max"] == pytest.approx(4 / (math.sqrt(26 / 7) + EPS), rel=1e-6)
    tags = ("A", "B") * 4  # A: 1, 0, 2, 2 (mean 1.25); B: 3, 0, 2, 6 (mean 2.75)
    m = step(batch_with(SCORES, env_tags=tags), reward_normalization=norm("inductive", "mean"))
    assert m["critic/rewards/max"] == pytest.approx(6 - 2.75)
    assert m["critic/rewards/min"] == pytest.approx(-2.75)


def test_asym_clip_and_identity():
    clipped = step(batch_with(SCORES), reward_normalization=norm("state", "asym_clip"))
    assert clipped["critic/rewards/max"] == pytest.approx(3 / (2 + EPS), rel=1e-6)  # within [-1, 3]
    plain = step(batch_with(SCORES), reward_normalization=norm("batch", "identity"))
    assert plain["critic/rewards/max"] == 6.0


def test_default_normalisation_trains_exactly_as_without_it():
    batch = random_batch(8, seed=6)
    a = Learner(tiny_policy(), make_cfg())
    b = Learner(tiny_policy(), make_cfg(reward_normalization=norm("inductive", "identity")))
    a.step(batch)
    b.step(batch)
    assert max_diff(weights(a.policy), weights(b.policy)) == 0.0


def test_inductive_grouping_needs_env_tags():
    learner = Learner(tiny_policy(), make_cfg(reward_normalization=norm("inductive", "mean_std")))
    before = weights(learner.policy)
    with pytest.raises(BadBatchError, match="grouping=inductive needs the batch's env_tags"):
        learner.step(batch_with(SCORES))
    assert max_diff(before, weights(learner.policy)) == 0.0


def test_turn_scores_reward_each_turn_for_gae():
    # two trained turns per row (random_batch): rewards 1 then 2, so with gamma = lam = 1 the return
    # is 3 on the first turn's tokens and 2 on the second's; the trajectory score plays no part
    turn_scores = torch.tensor([[1.0, 2.0]] * 8)
    m = step(batch_with(SCORES, turn_scores=turn_scores), use_turn_scores=True)
    assert m["critic/returns/max"] == pytest.approx(3.0)
    assert m["critic/returns/min"] == pytest.approx(2.0)
    assert m["critic/rewards/mean"] == pytest.approx(3.0)
    without = step(batch_with(SCORES, turn_scores=turn_scores))
    assert without["critic/returns/max"] == pytest.approx(6.0)  # the score on the last token


def test_turn_scores_with_grpo_sum_the_turns():
    # group 0's turn sums 1, 0, 0, 0 (mean 1/4, std 1/2), group 1's all 0
    turn_scores = torch.zeros(8, 2)
    turn_scores[0, 1] = 1.0
    m = step(batch_with(SCORES, turn_scores=turn_scores), adv_estimator="grpo", use_turn_scores=True)
    assert m["critic/advantages/max"] == pytest.approx(0.75 / (0.5 + EPS), rel=1e-6)
    assert m["critic/advantages/min"] == pytest.approx(-0.25 / (0.5 + EPS), rel=1e-6)
    assert (m["critic/rewards/max"], m["critic/rewards/min"]) == (1.0, 0.0)


def test_turn_scores_are_required():
    learner = Learner(tiny_policy(), make_cfg(use_turn_scores=True))
    with pytest.raises(BadBatchError, match="use_turn_scores=true needs the batch's turn_scores"):
        learner.step(batch_with(SCORES))


def test_soft_reweight_scales_each_group_by_its_std():
    # group 0: 1, 1, 1, 0 (std 1/2): GRPO gives 0.5 x3 and -1.5; group 1: 2, 0, 0, 0 (std 1): 1.5, -0.5 x3.
    # Weights 1/2 and 1: group 0's -1.5 becomes -0.75, so the smallest advantage is -0.75
    scores = [1.0, 1.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    plain = step(batch_with(scores), adv_estimator="grpo")
    assert plain["critic/advantages/min"] == pytest.approx(-0.75 / (0.5 + EPS), rel=1e-6)
    m = step(batch_with(scores), adv_estimator="grpo", soft_advantage_reweight=True)
    w0 = 0.5 / (1 + EPS)
    assert m["critic/advantages/min"] == pytest.approx(-0.75 / (0.5 + EPS) * w0, rel=1e-6)
    assert m["critic/advantages/max"] == pytest.approx(1.5 / (1 + EPS) / (1 + EPS), rel=1e-6)
    assert m["train/soft_reweight_min"] == pytest.approx(w0)
    assert m["train/soft_reweight_max"] == pytest.approx(1 / (1 + EPS))
    assert m["train/soft_reweight_mean"] == pytest.approx((w0 + 1 / (1 + EPS)) / 2)
    assert "train/soft_reweight_mean" not in plain


def test_length_weight_divides_by_relative_length():
    batch = batch_with([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    lengths = (batch.loss_mask != 0).sum(dim=1).double()
    scale = lengths.mean() / (lengths + EPS)
    # GRPO: row 0 gets 0.75 / 0.5, rows 1-3 -0.25 / 0.5, group 1 nothing
    m = step(batch, adv_estimator="grpo", grpo_advantage_length_weight=True)
    assert m["critic/advantages/max"] == pytest.approx(1.5 * float(scale[0]), rel=1e-5)
    assert m["critic/advantages/min"] == pytest.approx(-0.5 * float(scale[1:4].max()), rel=1e-5)


def test_zero_task_advantage_leaves_only_entropy_and_the_critic():
    learner = Learner(tiny_policy(), make_cfg(zero_task_advantage=True))
    critic_before, policy_before = weights(learner.critic), weights(learner.policy)
    m = learner.step(batch_with(SCORES))
    assert m["critic/advantages/max"] == m["critic/advantages/min"] == 0.0
    assert m["actor/pg_loss"] == 0.0
    assert max_diff(critic_before, weights(learner.critic)) > 0  # the critic still learns the returns
    assert max_diff(policy_before, weights(learner.policy)) > 0  # the entropy bonus still acts
