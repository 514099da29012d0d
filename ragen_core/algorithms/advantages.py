"""Advantage estimators (GAE, bi-level GAE, GRPO, RLOO, REINFORCE++), whitening, and the reweightings
and reward placements that RAGEN-2 applies around them.

Conventions (shared by every function here):

- Token tensors have shape ``(B, T)``: B trajectories, T token positions. ``mask`` marks the
  trained tokens (the tokens the policy sampled, docs/architecture.md, "Trajectory schema"); it
  may be bool or 0/1 numbers.
- Recursions run over the masked tokens *in order and skipping the rest*: the successor of a
  masked token is the next masked token of the same row, wherever it is. The environment's
  observation tokens between two assistant turns therefore neither discount nor carry value,
  which is what a multi-turn episode needs.
- Outputs are zero outside the mask and carry no gradient (advantages are targets).
- Empty inputs (B = 0 or T = 0) return empty outputs. NaN/inf rewards or scores raise ValueError
  naming the trajectories; so do mismatched shapes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ragen_core.algorithms._utils import (
    as_float,
    check_finite,
    check_ndim,
    check_same_shape,
    group_index,
    group_moments,
)

__all__ = [
    "bilevel_gae",
    "gae",
    "grpo",
    "length_weight",
    "reinforce_pp",
    "rloo",
    "soft_advantage_weights",
    "turn_rewards_to_tokens",
    "whiten",
]


def _masked_gae_scan(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    terminal: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reverse GAE scan linking consecutive masked positions of each row.

    For a masked position t with masked successor n(t) (none ⇒ V = 0, A = 0 beyond it):
        δ_t = r_t + γ·V_{n(t)} − V_t,    A_t = δ_t + γλ·A_{n(t)}.
    ``terminal[b, t]`` True cuts the link after t (treated as the end of an episode).
    Returns A, zero outside the mask.
    """
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_adv = rewards.new_zeros(batch)
    zero = rewards.new_zeros(batch)
    columns = []
    for t in reversed(range(length)):
        on = mask[:, t]
        if terminal is not None:
            next_value = torch.where(terminal[:, t], zero, next_value)
            next_adv = torch.where(terminal[:, t], zero, next_adv)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        columns.append(torch.where(on, adv_t, zero))
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, adv_t, next_adv)
    if not columns:
        return torch.zeros_like(rewards)
    return torch.stack(columns[::-1], dim=1)


def _check_token_inputs(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    check_ndim("token_rewards", token_rewards, 2)
    check_same_shape(token_rewards=token_rewards, values=values, mask=mask)


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over the masked tokens (Schulman et al. 2016).

    With n(t) the next masked position after t in the same row (V_{n(t)} = A_{n(t)} = 0 past the
    last masked token):

        δ_t = r_t + γ·V_{n(t)} − V_t
        A_t = δ_t + γλ·A_{n(t)}
        returns_t = A_t + V_t

    Unmasked tokens are skipped: they neither discount nor carry value. With γ = λ = 1 and the
    reward R on the last masked token, A_t = R − V_t and returns_t = R for every masked token.

    Args:
        token_rewards: (B, T) reward per token; must be zero outside the mask (a reward there would
            be silently lost, so it raises ValueError).
        values: (B, T) critic values V_t; ignored outside the mask.
        mask: (B, T) trained tokens.
        gamma, lam: discount γ and GAE λ.
    Returns:
        ``(advantages, returns)``, each (B, T), zero outside the mask, not whitened (see ``whiten``).
    """
    _check_token_inputs(token_rewards, values, mask)
    on = mask != 0
    token_rewards, values = as_float(token_rewards), as_float(values)
    check_finite(token_rewards, "reward")
    check_finite(values, "value", where=on)
    if bool(((token_rewards != 0) & ~on).any()):
        rows = torch.nonzero(((token_rewards != 0) & ~on).any(dim=1)).flatten().tolist()
        raise ValueError(f"token_rewards are non-zero outside the mask in trajectories {rows}")
    advantages = _masked_gae_scan(token_rewards, values, on, gamma, lam)
    returns = torch.where(on, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def _turn_ends(
    turn_rewards: torch.Tensor, on: torch.Tensor, turn_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check per-turn rewards against the turn structure; return ``(turn_index, end, present)``.

    ``end[b, k]`` is the last masked position of turn k of row b (-1 when the turn has no masked
    token, then ``present[b, k]`` is False). Raises ValueError for a non-finite reward, a turn index
    outside [0, K) or decreasing along a row's masked tokens, and a non-zero reward of an absent turn.
    """
    if turn_index.is_floating_point():
        raise ValueError(f"turn_index must be an integer tensor, got {turn_index.dtype}")
    check_finite(turn_rewards, "reward")
    batch, length = on.shape
    n_turns = turn_rewards.shape[1]
    turn_index = turn_index.long()
    if bool((on & ((turn_index < 0) | (turn_index >= n_turns))).any()):
        raise ValueError(
            f"turn_index must lie in [0, {n_turns}) on masked tokens (turn_rewards has {n_turns})"
        )
    running = torch.where(on, turn_index, torch.full_like(turn_index, -1)).cummax(dim=1).values
    if bool((on & (turn_index < running)).any()):
        raise ValueError("turn_index must be non-decreasing along each row's masked tokens")
    positions = torch.arange(length, device=on.device).expand(batch, length)
    bucket = torch.where(on, turn_index, torch.full_like(turn_index, n_turns))  # unmasked -> dummy K
    end = torch.full((batch, n_turns + 1), -1, dtype=torch.long, device=on.device)
    end = end.scatter_reduce(1, bucket, positions, reduce="amax", include_self=True)[:, :n_turns]
    present = end >= 0
    if bool(((turn_rewards != 0) & ~present).any()):
        raise ValueError("turn_rewards are non-zero for turns that have no masked token")
    return turn_index, end, present


@torch.no_grad()
def bilevel_gae(
    turn_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    turn_index: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    high_level_gamma: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bi-level (turn-level) GAE (RAGEN ``bi_level_gae``; docs/architecture.md, "Algorithms contract").

    Turns come from the turn structure: ``turn_index[b, t] = k`` says masked token t of row b
    belongs to turn k. The end e_k of turn k is its last masked token; a turn with no masked token
    is skipped (its reward must be 0). Let k' be the next present turn after k.

    High level, across turns, with γ_H = ``high_level_gamma`` (V beyond the last turn = 0):
        δ^H_k = R_k + γ_H·V_{e_k'} − V_{e_k},    A^H_k = δ^H_k + γ_H·λ·A^H_k',    G_k = A^H_k + V_{e_k}

    Low level, within each turn, with γ: turn k is an episode whose only reward is G_k on e_k and
    whose continuation is cut after e_k (next value 0). For the masked tokens t of turn k:
        δ_t = [t = e_k]·G_k + γ·V_{n(t)}·[t ≠ e_k] − V_t,    A_t = δ_t + γλ·A_{n(t)}·[t ≠ e_k]
    so A_{e_k} = A^H_k, and returns_t = A_t + V_t.

    Differences from RAGEN: turn ends are not "tokens with non-zero reward" (zero-reward turns are
    real turns), and the result is not whitened here (call ``whiten``, as for ``gae``).

    Args:
        turn_rewards: (B, K) reward of each turn (pad with 0 for rows with fewer turns).
        values: (B, T) critic values; mask: (B, T) trained tokens.
        turn_index: (B, T) integer turn of each token in [0, K); only masked tokens are read and,
            along each row's masked tokens, it must be non-decreasing (turns are in order).
    Returns:
        ``(advantages, returns)``, each (B, T), zero outside the mask.
    """
    check_ndim("values", values, 2)
    check_ndim("turn_rewards", turn_rewards, 2)
    check_same_shape(values=values, mask=mask, turn_index=turn_index)
    if turn_rewards.shape[0] != values.shape[0]:
        raise ValueError(
            f"shape mismatch: turn_rewards {tuple(turn_rewards.shape)} and values {tuple(values.shape)} "
            "must have the same batch size"
        )
    on = mask != 0
    turn_rewards, values = as_float(turn_rewards), as_float(values)
    check_finite(turn_rewards, "reward")
    check_finite(values, "value", where=on)
    turn_index, end, present = _turn_ends(turn_rewards, on, turn_index)
    n_turns = turn_rewards.shape[1]
    positions = torch.arange(values.shape[1], device=values.device).expand_as(values)

    # High level: GAE across turn ends.
    end_values = torch.where(present, values.gather(1, end.clamp_min(0)), torch.zeros_like(turn_rewards))
    high_adv = _masked_gae_scan(turn_rewards, end_values, present, high_level_gamma, lam)
    turn_return = torch.where(present, high_adv + end_values, torch.zeros_like(high_adv))

    # Low level: each turn is an episode ending at e_k with reward G_k.
    safe_turn = turn_index.clamp(0, max(n_turns - 1, 0))
    if n_turns == 0:
        is_end = torch.zeros_like(on)
        low_rewards = torch.zeros_like(values)
    else:
        is_end = on & (end.gather(1, safe_turn) == positions)
        low_rewards = torch.where(is_end, turn_return.gather(1, safe_turn), torch.zeros_like(values))
    advantages = _masked_gae_scan(low_rewards, values, on, gamma, lam, terminal=is_end)
    returns = torch.where(on, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


@torch.no_grad()
def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening over the whole batch (veRL ``masked_whiten``).

        μ = Σ m·x / Σ m,    σ² = Σ m·(x − μ)² / (Σ m − 1)    (unbiased)
        x' = (x − μ) / sqrt(σ² + eps)        (+ μ again if ``shift_mean`` is False)

    Zero outside the mask. No masked element ⇒ all zeros; a single masked element has σ² := 0.
    """
    check_same_shape(x=x, mask=mask)
    on = mask != 0
    x = as_float(x)
    n = int(on.sum())
    zeros = torch.zeros_like(x)
    if n == 0:
        return zeros
    xm = torch.where(on, x, zeros)
    mean = xm.sum() / n
    var = torch.where(on, (x - mean) ** 2, zeros).sum() / (n - 1) if n > 1 else x.new_zeros(())
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(on, out, zeros)


def _per_trajectory_scores(scores: torch.Tensor) -> torch.Tensor:
    check_ndim("scores", scores, 1)
    scores = as_float(scores)
    check_finite(scores, "reward")
    return scores


@torch.no_grad()
def grpo(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO group-relative advantage per trajectory (Shao et al. 2024).

    Groups are the initial-state groups (docs/architecture.md, "Deliberate differences from RAGEN":
    GRPO groups).

        A_i = (s_i − mean_g) / (std_g + eps)    (norm_by_std; else A_i = s_i − mean_g)

    over the group g of i (trajectories sharing an initial state), std unbiased. A group whose
    scores are all equal gets A = 0. A group of size 1 gets A = 0 (no baseline exists; veRL instead
    uses mean 0, std 1, i.e. A = s). Groups are any hashable ids; empty input gives an empty result.
    The caller broadcasts A_i to the trajectory's tokens.

    Args:
        scores: (N,) total score of each trajectory. group_ids: N group ids.
    Returns:
        (N,) advantages.
    """
    scores = _per_trajectory_scores(scores)
    index, n_groups = group_index(group_ids, scores.shape[0])
    if n_groups == 0:
        return torch.zeros_like(scores)
    count, mean, std = group_moments(scores, index, n_groups)
    index = index.to(scores.device)
    centred = scores - mean[index]
    adv = centred / (std[index] + eps) if norm_by_std else centred
    return torch.where(count[index] > 1, adv, torch.zeros_like(adv))


@torch.no_grad()
def rloo(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """REINFORCE leave-one-out advantage per trajectory (Ahmadian et al. 2024).

        A_i = s_i − (1 / (n_g − 1)) Σ_{j ∈ g, j ≠ i} s_j  =  n_g / (n_g − 1) · (s_i − mean_g)

    A group of size 1 gets A = 0. Returns (N,) advantages (broadcast to tokens by the caller).
    """
    scores = _per_trajectory_scores(scores)
    index, n_groups = group_index(group_ids, scores.shape[0])
    if n_groups == 0:
        return torch.zeros_like(scores)
    count, mean, _ = group_moments(scores, index, n_groups)
    index = index.to(scores.device)
    n = count[index]
    adv = (scores - mean[index]) * n / (n - 1).clamp_min(1)
    return torch.where(n > 1, adv, torch.zeros_like(adv))


@torch.no_grad()
def reinforce_pp(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025; veRL ``reinforce_plus_plus``): discounted returns, whitened over the batch.

        r'_t = r_t − β·kl_t                       (β = ``kl_coef``; kl_t e.g. kl_penalty(old, ref, "k1"))
        G_t  = r'_t + γ·G_{n(t)}                  (n(t): next masked token, as in ``gae``)
        A    = whiten(G, mask)

    No critic: this is ``gae`` with V = 0 and λ = 1, then batch whitening.
    Returns ``(advantages, returns)``, each (B, T), zero outside the mask.
    """
    check_ndim("token_rewards", token_rewards, 2)
    check_same_shape(token_rewards=token_rewards, mask=mask)
    rewards = as_float(token_rewards)
    if kl is not None and kl_coef != 0.0:
        check_same_shape(token_rewards=token_rewards, kl=kl)
        rewards = rewards - kl_coef * torch.where(mask != 0, as_float(kl), torch.zeros_like(rewards))
    _, returns = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return whiten(returns, mask), returns


@torch.no_grad()
def turn_rewards_to_tokens(
    turn_rewards: torch.Tensor, mask: torch.Tensor, turn_index: torch.Tensor
) -> torch.Tensor:
    """Per-turn rewards as token rewards: each turn's reward on its last masked token (RAGEN-2's
    ``use_turn_scores``).

        r_t = R_k   if t = e_k (the last masked token of turn k),   else 0

    ``turn_index`` numbers the masked tokens' turns in [0, K), non-decreasing along a row (as for
    ``bilevel_gae``); a turn without masked tokens must have reward 0 (it would be lost).

    Args:
        turn_rewards: (B, K) reward of each turn, 0-padded. mask, turn_index: (B, T).
    Returns:
        (B, T) token rewards, zero outside the mask; Σ_t r_t = Σ_k R_k for every row.
    """
    check_ndim("turn_rewards", turn_rewards, 2)
    check_ndim("mask", mask, 2)
    check_same_shape(mask=mask, turn_index=turn_index)
    if turn_rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"shape mismatch: turn_rewards {tuple(turn_rewards.shape)} and mask {tuple(mask.shape)} "
            "must have the same batch size"
        )
    on = mask != 0
    turn_rewards = as_float(turn_rewards)
    _, end, present = _turn_ends(turn_rewards, on, turn_index)
    out = torch.zeros(on.shape, dtype=turn_rewards.dtype, device=turn_rewards.device)
    rows, turns = torch.nonzero(present, as_tuple=True)
    out[rows, end[rows, turns]] = turn_rewards[rows, turns]
    return out


@torch.no_grad()
def soft_advantage_weights(
    scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Hashable], eps: float = 1e-6
) -> torch.Tensor:
    """Per-trajectory weights of RAGEN-2's ``soft_advantage_reweight``: a group's weight grows with its
    score spread, so low-variance groups are down-weighted instead of filtered out.

        w_i = std_g / (max_h std_h + eps)      (g the group of i; std unbiased)

    A group of one has no spread: std := 0 (it neither gets weight nor sets the maximum; its GRPO
    advantage is 0 anyway). All groups without spread give w = 0.

    Args:
        scores: (N,) the scores the group advantage is computed from. group_ids: N group keys.
    Returns:
        (N,) weights in [0, 1).
    """
    scores = _per_trajectory_scores(scores)
    index, n_groups = group_index(group_ids, scores.shape[0])
    if n_groups == 0:
        return torch.zeros_like(scores)
    count, _, std = group_moments(scores, index, n_groups)
    std = torch.where(count > 1, std, torch.zeros_like(std))
    weights = std / (std.max() + eps)
    return weights[index.to(scores.device)]


@torch.no_grad()
def length_weight(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantages divided by each trajectory's relative length (RAGEN-2's ``grpo_advantage_length_weight``).

        L_i = Σ_t m_it,    A'_it = A_it · mean_j(L_j) / (L_i + eps)

    so every trajectory contributes about the same total advantage to a token-mean loss, whatever
    its length. Zero outside the mask.

    Args:
        advantages, mask: (B, T).
    Returns:
        (B, T) reweighted advantages.
    """
    check_ndim("advantages", advantages, 2)
    check_same_shape(advantages=advantages, mask=mask)
    on = mask != 0
    advantages = as_float(advantages)
    if on.shape[0] == 0:
        return torch.zeros_like(advantages)
    lengths = on.sum(dim=1).to(advantages.dtype)
    relative = (lengths + eps) / lengths.mean()
    return torch.where(on, advantages / relative[:, None], torch.zeros_like(advantages))
