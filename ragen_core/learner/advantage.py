"""Rewards and advantages of a learner step (docs/architecture.md, "Learner step", steps 3 and 4).

Token rewards: the trajectory score (after RAGEN-2's reward normalisation, when configured) on its last
trained token, or with ``use_turn_scores`` each trained turn's score on its last token, minus
``kl_coef`` x KL(old || ref) on every trained token when ``use_kl_in_reward``. Then the configured
advantage estimator, found by name in ``ragen_core.algorithms.registry``, and RAGEN-2's advantage
options on its result (soft reweighting, length weighting, zeroing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from ragen_core.algorithms import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    kl_penalty,
    length_weight,
    normalize_scores,
    soft_advantage_weights,
    turn_rewards_to_tokens,
)
from ragen_core.config.learner import AlgorithmConfig
from ragen_core.learner.batch import TokenBatch

__all__ = ["Advantages", "advantages", "dense_turns", "token_rewards", "turn_rewards"]


def dense_turns(turn_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Renumber each row's trained turns 0, 1, 2, ... in order (padding / env tokens get 0)."""
    masked = torch.where(mask, turn_index, torch.full_like(turn_index, -(2**62)))
    prev = torch.cummax(masked, dim=1).values
    prev = torch.cat([torch.full_like(prev[:, :1], -(2**62)), prev[:, :-1]], dim=1)
    new_turn = mask & (turn_index != prev)
    dense = torch.cumsum(new_turn.long(), dim=1) - 1
    return torch.where(mask, dense, torch.zeros_like(dense))


def turn_rewards(
    batch: TokenBatch, turn_scores: torch.Tensor | None, mask: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(turns, turn_rewards)``: each row's trained turns numbered 0, 1, ... (``dense_turns``) and
    the reward of each, (B, K): the batch's turn scores, or without them the trajectory score on
    its last trained turn. On ``mask``'s device."""
    dev = mask.device
    turns = dense_turns(batch.turn_index[:, : mask.shape[1]].to(dev), mask)
    n_turns = int(turns.max()) + 1
    if turn_scores is None:  # the trajectory score on its last trained turn
        rewards = torch.zeros(mask.shape[0], n_turns, dtype=dtype, device=dev)
        last_turn = torch.where(mask, turns, torch.zeros_like(turns)).max(dim=1).values
        rewards[torch.arange(mask.shape[0], device=dev), last_turn] = batch.scores.to(dev, dtype)
    else:
        rewards = torch.zeros(mask.shape[0], max(n_turns, turn_scores.shape[1]), dtype=dtype, device=dev)
        rewards[:, : turn_scores.shape[1]] = turn_scores.to(dev, dtype)
    return turns, rewards


def _score_groups(batch: TokenBatch, alg: AlgorithmConfig) -> torch.Tensor | tuple[str, ...] | list[int]:
    """The group key of each row for reward normalisation (``reward_normalization.grouping``)."""
    grouping = alg.reward_normalization.grouping
    if grouping == "state":
        return batch.group_ids
    if grouping == "inductive":
        return cast("tuple[str, ...]", batch.env_tags)  # checked by check_batch
    return [0] * len(batch.scores)


def token_rewards(
    batch: TokenBatch,
    alg: AlgorithmConfig,
    scores: torch.Tensor,
    mask: torch.Tensor,
    turn_scores: torch.Tensor | None,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(token_rewards, kl_in_reward)``, each (B, L) on ``mask``'s device in ``scores``' dtype: the
    (normalised) score on the last trained token, or each trained turn's score on its last token
    (``use_turn_scores``), minus ``kl_coef`` x the in-reward KL (returned, None when off)."""
    maskf = mask.to(scores.dtype)
    if alg.use_turn_scores:
        turns, rewards = turn_rewards(batch, turn_scores, mask, scores.dtype)
        out = turn_rewards_to_tokens(rewards, mask, turns)
    else:
        norm = alg.reward_normalization
        rewarded = normalize_scores(scores, _score_groups(batch, alg), norm.method) if norm.active else scores
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
        out = torch.zeros_like(maskf)
        out[torch.arange(mask.shape[0], device=mask.device), last] = rewarded
    kl_in_reward = None
    if alg.use_kl_in_reward:
        assert ref_logp is not None  # use_kl_in_reward implies use_ref
        kl_in_reward = kl_penalty(old_logp, ref_logp, alg.kl_in_reward_type) * maskf
        out = out - alg.kl_coef * kl_in_reward
    return out, kl_in_reward


def _options(
    adv: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    alg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """RAGEN-2's options applied to the estimator's advantages, in its order: soft reweighting by
    the group's score std, division by the relative length (both GRPO only), zeroing."""
    metrics: dict[str, float] = {}
    if alg.soft_advantage_reweight:
        weight = soft_advantage_weights(rewards.sum(dim=1), group_ids)  # GRPO's own scores
        adv = adv * weight[:, None]
        first: dict[int, int] = {}  # one weight per group, as RAGEN-2 reports them
        for row, g in enumerate(group_ids.tolist()):
            first.setdefault(g, row)
        per_group = weight[list(first.values())]
        metrics["train/soft_reweight_min"] = float(per_group.min())
        metrics["train/soft_reweight_max"] = float(per_group.max())
        metrics["train/soft_reweight_mean"] = float(per_group.mean())
    if alg.grpo_advantage_length_weight:
        adv = length_weight(adv, mask)
    if alg.zero_task_advantage:
        adv = torch.zeros_like(adv)
    return adv, metrics


@dataclass(frozen=True)
class Advantages:
    """A step's advantages and critic targets, (B, L), and the options' metrics."""

    advantages: torch.Tensor
    returns: torch.Tensor
    metrics: dict[str, float]


def advantages(
    batch: TokenBatch,
    alg: AlgorithmConfig,
    rewards: torch.Tensor,
    kl_in_reward: torch.Tensor | None,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    turn_scores: torch.Tensor | None,
    scale: float = 1.0,
) -> Advantages:
    """The configured estimator (``ADV_ESTIMATORS[alg.adv_estimator]``) on the token rewards, then
    RAGEN-2's options, times ``scale`` (``rollout.filter.loss_scaling``; the returns are not scaled)."""
    group_ids = batch.group_ids.to(mask.device)
    inputs = AdvantageInputs(
        token_rewards=rewards,
        mask=mask,
        group_ids=group_ids,
        values=values,
        kl_in_reward=kl_in_reward,
        turn_rewards=lambda: turn_rewards(batch, turn_scores, mask, rewards.dtype),
        settings=alg,
    )
    adv, returns = ADV_ESTIMATORS[alg.adv_estimator].fn(inputs)
    adv, metrics = _options(adv, rewards, mask, group_ids, alg)
    if scale != 1.0:
        adv = adv * scale
    return Advantages(adv, returns, metrics)
