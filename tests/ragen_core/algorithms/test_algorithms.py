"""Tests for ragen_core.algorithms against hand-computed values and slow float64 loop references."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_core.algorithms import (
    agg_loss,
    bilevel_gae,
    entropy_from_logits,
    filter_rollouts,
    gae,
    group_std_stats,
    grpo,
    kept_group_count,
    kl_penalty,
    masked_mean,
    policy_loss,
    reinforce_pp,
    rloo,
    value_loss,
    whiten,
)

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


# ----------------------------------------------------------------------------- reference implementations


def ref_gae(rewards, values, mask, gamma, lam):
    """Per row: list the masked positions, then the textbook reverse recursion over that list."""
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        pos = [t for t in range(len(mask[b])) if mask[b][t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(pos):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            a = delta + gamma * lam * next_a
            adv[b][t], ret[b][t] = a, a + values[b][t]
            next_v, next_a = values[b][t], a
    return adv, ret


def ref_bilevel(turn_rewards, values, mask, turn_index, gamma, lam, hgamma):
    """RAGEN's compute_bi_level_gae_advantage_return loop, turn ends taken from turn_index."""
    adv = [[0.0] * len(v) for v in values]
    ret = [[0.0] * len(v) for v in values]
    for b in range(len(values)):
        valid = [t for t in range(len(mask[b])) if mask[b][t]]
        ends = {}
        for t in valid:
            ends[turn_index[b][t]] = t  # last masked token of each turn
        eos = [ends[k] for k in sorted(ends)]
        reward_at = {ends[k]: turn_rewards[b][k] for k in ends}
        updated = {}
        last = 0.0
        high = {}
        for i in range(len(eos) - 1, -1, -1):
            nv = values[b][eos[i + 1]] if i < len(eos) - 1 else 0.0
            delta = reward_at[eos[i]] + hgamma * nv - values[b][eos[i]]
            last = delta + hgamma * lam * last
            high[eos[i]] = last
        for p in eos:
            updated[p] = high[p] + values[b][p]
        last = 0.0
        for i in range(len(valid) - 1, -1, -1):
            cur = valid[i]
            if cur not in updated:
                nv = values[b][valid[i + 1]]
                r = 0.0
            else:
                nv, last, r = 0.0, 0.0, updated[cur]
            delta = r + gamma * nv - values[b][cur]
            last = delta + gamma * lam * last
            adv[b][cur], ret[b][cur] = last, last + values[b][cur]
    return adv, ret


def ref_whiten(x, mask, shift_mean=True, eps=1e-8):
    vals = [x[b][t] for b in range(len(x)) for t in range(len(x[b])) if mask[b][t]]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    out = [[0.0] * len(r) for r in x]
    for b in range(len(x)):
        for t in range(len(x[b])):
            if mask[b][t]:
                out[b][t] = (x[b][t] - mean) / math.sqrt(var + eps) + (0.0 if shift_mean else mean)
    return out


def ref_policy_token(lp, old, a, cl, ch, c):
    ratio = math.exp(lp - old)
    l1 = -a * ratio
    l2 = -a * min(max(ratio, 1 - cl), 1 + ch)
    lc = max(l1, l2)
    if c is not None and a < 0:
        return min(lc, -a * c), l2 > l1, lc > -a * c
    return lc, l2 > l1, False


def random_mask(gen, batch, length, p=0.6):
    mask = torch.rand(batch, length, generator=gen) < p
    mask[:, 0] = True  # every row has at least one token
    return mask


# ----------------------------------------------------------------------------- gae


def test_gae_hand_example_with_gap():
    # mask [1,0,1,1]: position 1 is an observation token between two assistant turns.
    rewards = t64([[0.0, 0.0, 0.0, 1.0]])
    values = t64([[0.5, 9.0, 0.2, 0.4]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # t=3: δ=1-0.4=0.6 ; t=2: δ=0.5*0.4-0.2=0, A=0.5*0.6=0.3 ; t=0: δ=0.5*0.2-0.5=-0.4, A=-0.4+0.15
    torch.testing.assert_close(adv, t64([[-0.25, 0.0, 0.3, 0.6]]))
    torch.testing.assert_close(ret, t64([[0.25, 0.0, 0.5, 1.0]]))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0), (0.99, 0.7)])
def test_gae_matches_reference_with_gaps(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    mask = random_mask(gen, 6, 13)
    mask[3] = False  # an empty row
    rewards = torch.randn(6, 13, generator=gen, dtype=F64) * mask
    values = torch.randn(6, 13, generator=gen, dtype=F64)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    radv, rret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, t64(radv))
    torch.testing.assert_close(ret, t64(rret))
    assert not adv.requires_grad


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 12),
    st.integers(0, 2**31 - 1),
    st.floats(-5, 5, allow_nan=False),
)
def test_gae_gamma_lambda_one_is_return_minus_value(batch, length, seed, reward):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, batch, length, p=0.5)
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    rewards = torch.zeros(batch, length, dtype=F64)
    last = torch.stack([row.nonzero().max() for row in mask])
    rewards[torch.arange(batch), last] = reward
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, (reward - values) * mask)
    torch.testing.assert_close(ret, reward * mask.to(F64))


def test_gae_ignores_values_off_mask_and_zero_outside():
    mask = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)
    rewards = t64([[0.0, 0.0, 1.0, 0.0]])
    v1 = t64([[0.1, float("nan"), 0.3, float("inf")]])
    v2 = t64([[0.1, 5.0, 0.3, -7.0]])
    a1, r1 = gae(rewards, v1, mask, 0.9, 0.9)
    a2, r2 = gae(rewards, v2, mask, 0.9, 0.9)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)
    assert a1[0, 1] == 0 and a1[0, 3] == 0 and r1[0, 3] == 0


def test_gae_validation_and_empty():
    with pytest.raises(ValueError, match=r"token_rewards \(2, 3\), values \(2, 4\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    bad = torch.zeros(3, 2)
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite reward in trajectories \[1\]"):
        gae(bad, torch.zeros(3, 2), torch.ones(3, 2), 1.0, 1.0)
    with pytest.raises(ValueError, match="outside the mask"):
        gae(t64([[0.0, 1.0]]), torch.zeros(1, 2, dtype=F64), torch.tensor([[1, 0]]), 1.0, 1.0)
    adv, ret = gae(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5), 1.0, 1.0)
    assert adv.shape == ret.shape == (0, 5)
    adv, _ = gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), 1.0, 1.0)
    assert adv.shape == (2, 0)


# ----------------------------------------------------------------------------- bi-level gae


def test_bilevel_gae_hand_example():
    # Two turns: tokens 0,1 (turn 0), observation at 2, tokens 3,4 (turn 1). gamma=lam=1.
    values = t64([[0.1, 0.2, 7.0, 0.3, 0.4]])
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    turn_index = torch.tensor([[0, 0, 0, 1, 1]])
    # first turn earns nothing: still a turn end (docs/architecture.md, "Deliberate differences
    # from RAGEN": turn ends)
    turn_rewards = t64([[0.0, 1.0]])
    adv, ret = bilevel_gae(turn_rewards, values, mask, turn_index, gamma=1.0, lam=1.0, high_level_gamma=0.5)
    # high level: A1 = 1 - 0.4 = 0.6, G1 = 1 ; A0 = 0 + 0.5*0.4 - 0.2 + 0.5*0.6 = 0.3, G0 = 0.5
    # low level: turn 0: pos1 A = 0.5-0.2 = 0.3 ; pos0 A = 0.2-0.1+0.3 = 0.4 ; turn 1: pos4 0.6, pos3 0.7
    torch.testing.assert_close(adv, t64([[0.4, 0.3, 0.0, 0.7, 0.6]]))
    torch.testing.assert_close(ret, t64([[0.5, 0.5, 0.0, 1.0, 1.0]]))


@pytest.mark.parametrize(("gamma", "lam", "hgamma"), [(1.0, 1.0, 0.95), (0.9, 0.8, 0.5), (1.0, 0.0, 1.0)])
def test_bilevel_gae_matches_reference(gamma, lam, hgamma):
    gen = torch.Generator().manual_seed(1)
    batch, length, turns = 5, 16, 4
    mask = random_mask(gen, batch, length)
    # turns in order: split positions into `turns` contiguous blocks, per row at random cut points
    turn_index = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        cuts = sorted(torch.randint(1, length, (turns - 1,), generator=gen).tolist())
        for c in cuts:
            turn_index[b, c:] += 1
    present = torch.zeros(batch, turns, dtype=torch.bool)
    for b in range(batch):
        present[b, turn_index[b][mask[b]].unique()] = True
    turn_rewards = torch.randn(batch, turns, generator=gen, dtype=F64) * present
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    adv, ret = bilevel_gae(turn_rewards, values, mask, turn_index, gamma, lam, hgamma)
    radv, rret = ref_bilevel(
        turn_rewards.tolist(), values.tolist(), mask.tolist(), turn_index.tolist(), gamma, lam, hgamma
    )
    torch.testing.assert_close(adv, t64(radv))
    torch.testing.assert_close(ret, t64(rret))


def test_bilevel_single_turn_equals_gae():
    gen = torch.Generator().manual_seed(2)
    mask = random_mask(gen, 3, 9)
    values = torch.randn(3, 9, generator=gen, dtype=F64)
    r = t64([[1.5], [-0.5], [0.0]])
    rewards = torch.zeros(3, 9, dtype=F64)
    last = torch.stack([row.nonzero().max() for row in mask])
    rewards[torch.arange(3), last] = r[:, 0]
    adv_b, ret_b = bilevel_gae(r, values, mask, torch.zeros(3, 9, dtype=torch.long), 0.9, 0.8, 0.95)
    adv_g, ret_g = gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv_b, adv_g)
    torch.testing.assert_close(ret_b, ret_g)


def test_bilevel_gae_validation():
    v, m = torch.zeros(1, 3), torch.ones(1, 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        bilevel_gae(torch.zeros(1, 2), v, m, torch.tensor([[0, 1, 0]]))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        bilevel_gae(torch.zeros(1, 2), v, m, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="no masked token"):
        bilevel_gae(torch.tensor([[0.0, 0.0, 1.0]]), v, m, torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="shape mismatch"):
        bilevel_gae(torch.zeros(1, 2), v, m, torch.zeros(1, 4, dtype=torch.long))
    # turn_index off the mask is ignored (e.g. -1 padding)
    adv, _ = bilevel_gae(torch.tensor([[1.0]]), v, torch.tensor([[1, 1, 0]]), torch.tensor([[0, 0, -1]]))
    assert adv[0, 2] == 0


# ----------------------------------------------------------------------------- whiten


def test_whiten_matches_reference_and_moments():
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(gen, 4, 10)
    x = torch.randn(4, 10, generator=gen, dtype=F64) * 3 + 2
    out = whiten(x, mask)
    torch.testing.assert_close(out, t64(ref_whiten(x.tolist(), mask.tolist())))
    sel = out[mask]
    assert abs(sel.mean().item()) < 1e-12
    assert abs(sel.var().item() - 1) < 1e-6
    assert (out[~mask] == 0).all()
    out2 = whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(out2, t64(ref_whiten(x.tolist(), mask.tolist(), shift_mean=False)))


def test_whiten_degenerate():
    assert (whiten(torch.ones(2, 3), torch.zeros(2, 3)) == 0).all()
    out = whiten(t64([[5.0, 1.0]]), torch.tensor([[1, 0]]))
    torch.testing.assert_close(out, t64([[0.0, 0.0]]))
    out = whiten(t64([[5.0, 1.0]]), torch.tensor([[1, 0]]), shift_mean=False)
    torch.testing.assert_close(out, t64([[5.0, 0.0]]))
    with pytest.raises(ValueError, match="shape mismatch"):
        whiten(torch.zeros(2, 3), torch.zeros(3, 2))


# ----------------------------------------------------------------------------- grpo / rloo / reinforce++


def test_grpo_hand_values():
    scores = t64([1.0, 0.0, 3.0, 2.0, 2.0, 5.0])
    groups = [0, 0, 1, 1, 1, 7]  # group 7 has size 1
    adv = grpo(scores, groups, eps=0.0)
    s = 1 / math.sqrt(0.5)  # group 0: mean 0.5, unbiased std sqrt(0.5)
    # group 1: mean 7/3, deviations 2/3,-1/3,-1/3, var = (4/9+1/9+1/9)/2 = 1/3
    g1 = math.sqrt(1 / 3)
    expected = t64([0.5 * s, -0.5 * s, (2 / 3) / g1, (-1 / 3) / g1, (-1 / 3) / g1, 0.0])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(
        grpo(scores, groups, norm_by_std=False), t64([0.5, -0.5, 2 / 3, -1 / 3, -1 / 3, 0])
    )


def test_grpo_all_equal_size_one_strings_and_empty():
    adv = grpo(t64([2.0, 2.0, 2.0, 1.0]), ["a", "a", "a", "b"])
    assert (adv == 0).all()
    assert grpo(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    # int scores are accepted and give float advantages
    assert grpo(torch.tensor([0, 1]), [0, 0]).dtype == torch.get_default_dtype()


def test_grpo_validation():
    with pytest.raises(ValueError, match=r"non-finite reward in trajectories \[2\]"):
        grpo(torch.tensor([0.0, 1.0, float("nan")]), [0, 0, 1])
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo(torch.zeros(3), [0, 0])
    with pytest.raises(ValueError, match="1-D"):
        grpo(torch.zeros(3, 2), [0, 0, 1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=30))
def test_grpo_and_rloo_group_means_are_zero(items):
    groups = [g for g, _ in items]
    scores = t64([s for _, s in items])
    for adv in (grpo(scores, groups), rloo(scores, groups)):
        assert torch.isfinite(adv).all()
        for g in set(groups):
            sel = torch.tensor([x == g for x in groups])
            assert abs(adv[sel].sum().item()) < 1e-6 * max(1, sel.sum().item())


def test_rloo_matches_leave_one_out_loop():
    scores = [3.0, 1.0, 2.0, 0.0, 4.0, 9.0]
    groups = [1, 1, 1, 2, 2, 3]
    expected = []
    for i, (s, g) in enumerate(zip(scores, groups, strict=True)):
        others = [x for j, (x, h) in enumerate(zip(scores, groups, strict=True)) if h == g and j != i]
        expected.append(s - sum(others) / len(others) if others else 0.0)
    torch.testing.assert_close(rloo(t64(scores), torch.tensor(groups)), t64(expected))


def test_reinforce_pp_matches_reference():
    gen = torch.Generator().manual_seed(4)
    mask = random_mask(gen, 4, 8)
    rewards = torch.randn(4, 8, generator=gen, dtype=F64) * mask
    kl = torch.randn(4, 8, generator=gen, dtype=F64)
    gamma, beta = 0.9, 0.1
    adv, ret = reinforce_pp(rewards, mask, gamma=gamma, kl=kl, kl_coef=beta)
    r2 = ((rewards - beta * kl) * mask).tolist()
    _, rret = ref_gae(r2, [[0.0] * 8] * 4, mask.tolist(), gamma, 1.0)
    torch.testing.assert_close(ret, t64(rret))
    torch.testing.assert_close(adv, t64(ref_whiten(rret, mask.tolist())))


# ----------------------------------------------------------------------------- policy / value losses


def test_policy_loss_matches_reference_all_branches():
    # one token per branch: A>0 ratio high (clipped at 1.28), A>0 inside, A<0 ratio low (clipped at 0.8),
    # A<0 huge ratio (dual clip at 3), A<0 inside; plus one masked-out token.
    logp = t64([[math.log(1.5), math.log(1.1), math.log(0.5), math.log(5.0), math.log(0.9), 0.0]])
    old = torch.zeros_like(logp)
    advs = t64([[1.0, 2.0, -1.0, -2.0, -0.5, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, metrics = policy_loss(logp, old, advs, mask)
    toks = [
        ref_policy_token(lp, 0.0, a, 0.2, 0.28, 3.0)
        for lp, a in zip(logp[0, :5].tolist(), advs[0, :5].tolist(), strict=True)
    ]
    assert [round(x[0], 12) for x in toks] == [round(v, 12) for v in [-1.28, -2.2, 0.8, 6.0, 0.45]]
    assert loss.item() == pytest.approx(sum(x[0] for x in toks) / 5)
    assert metrics["clipfrac"].item() == pytest.approx(sum(x[1] for x in toks) / 5)
    assert metrics["clipfrac_lower"].item() == pytest.approx(0.2)
    assert metrics["approx_kl"].item() == pytest.approx(-logp[0, :5].mean().item())
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_policy_loss_random_reference_and_gradient_flow():
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(gen, 3, 7)
    logp = (torch.randn(3, 7, generator=gen, dtype=F64) * 0.5).requires_grad_()
    old = torch.randn(3, 7, generator=gen, dtype=F64) * 0.5
    adv = torch.randn(3, 7, generator=gen, dtype=F64)
    for cl, ch, c in [(0.2, 0.28, 3.0), (0.1, 0.1, None)]:
        loss, _ = policy_loss(logp, old, adv, mask, cl, ch, c)
        vals = [
            ref_policy_token(logp[b, t].item(), old[b, t].item(), adv[b, t].item(), cl, ch, c)[0]
            for b in range(3)
            for t in range(7)
            if mask[b, t]
        ]
        assert loss.item() == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    loss.backward()
    assert logp.grad is not None and (logp.grad[~mask] == 0).all()
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="shape mismatch: logp"):
        policy_loss(logp, old[:, :3], adv, mask)


def test_policy_loss_empty_mask_is_zero():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0 and metrics["clipfrac"].item() == 0
    loss.backward()
    assert (logp.grad == 0).all()


def test_value_loss_matches_reference():
    values = t64([[1.0, 0.0, 2.0, 0.5]])
    old = t64([[0.0, 0.0, 1.0, 0.5]])
    returns = t64([[0.0, 1.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5)
    # tok0: unclipped 1, clipped v=0.5 -> .25, max 1 ; tok1: 1, 1 ; tok2: 4 vs v=1.5 -> 2.25, max 4
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 4) / 3)
    assert metrics["vf_clipfrac"].item() == 0.0
    # a prediction moving away from the target beyond the clip: clipped loss is larger
    loss, metrics = value_loss(t64([[0.6]]), t64([[0.0]]), t64([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.5 * 2.56)
    assert metrics["vf_clipfrac"].item() == 0.0
    loss, metrics = value_loss(t64([[-0.6]]), t64([[0.0]]), t64([[1.0]]), torch.ones(1, 1), clip=0.5)
    assert loss.item() == pytest.approx(0.5 * 1.6**2)
    loss, metrics = value_loss(t64([[2.0]]), t64([[0.0]]), t64([[1.5]]), torch.ones(1, 1), clip=0.5)
    # unclipped (0.5)^2 = .25 ; clipped v=0.5 -> 1.0 : clipped wins
    assert loss.item() == pytest.approx(0.5) and metrics["vf_clipfrac"].item() == 1.0
    loss, _ = value_loss(t64([[2.0]]), t64([[0.0]]), t64([[1.5]]), torch.ones(1, 1), clip=None)
    assert loss.item() == pytest.approx(0.125)


# ----------------------------------------------------------------------------- aggregation and micro-batching


def test_agg_loss_hand_values_and_errors():
    loss = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(loss, mask, "token-mean", global_token_count=7).item() == pytest.approx(1.0)
    assert agg_loss(loss, mask, "seq-mean-token-sum", global_seq_count=7).item() == pytest.approx(1.0)
    assert agg_loss(loss, torch.zeros(3, 3), "seq-mean-token-mean").item() == 0
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        agg_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="global_token_count"):
        agg_loss(loss, mask, "token-mean", global_token_count=0)
    # inf/NaN off the mask do not leak
    loss[2, 2] = float("inf")
    loss[0, 2] = float("nan")
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert masked_mean(t64([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0])).item() == 2.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_split_gives_same_gradient(mode):
    gen = torch.Generator().manual_seed(6)
    batch, length = 8, 11
    mask = torch.rand(batch, length, generator=gen) < torch.linspace(0.1, 0.9, batch)[:, None]
    mask[0] = False  # a sequence without trained tokens
    mask[1, 3] = True
    logp0 = torch.randn(batch, length, generator=gen, dtype=F64) * 0.3
    old = logp0 + torch.randn(batch, length, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(batch, length, generator=gen, dtype=F64)
    n_tok = int(mask.sum())
    n_seq = int((mask.sum(-1) > 0).sum())
    grads, losses = [], []
    for n_micro in (1, 2, 4, 8):
        logp = logp0.clone().requires_grad_()
        total = torch.zeros((), dtype=F64)
        for idx in torch.arange(batch).chunk(n_micro):
            loss, _ = policy_loss(
                logp[idx],
                old[idx],
                adv[idx],
                mask[idx],
                agg=mode,
                global_token_count=n_tok,
                global_seq_count=n_seq,
            )
            total = total + loss
        total.backward()
        grads.append(logp.grad.clone())
        losses.append(total.item())
    for g, loss_value in zip(grads[1:], losses[1:], strict=True):
        torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=0)
        assert loss_value == pytest.approx(losses[0], abs=1e-9)
    # and the full-batch value matches the defaults (own counts)
    full, _ = policy_loss(logp0, old, adv, mask, agg=mode)
    assert full.item() == pytest.approx(losses[0], abs=1e-9)


def test_micro_batch_value_loss_split():
    gen = torch.Generator().manual_seed(7)
    mask = random_mask(gen, 8, 6)
    v0 = torch.randn(8, 6, generator=gen, dtype=F64)
    old, ret = torch.randn(8, 6, generator=gen, dtype=F64), torch.randn(8, 6, generator=gen, dtype=F64)
    full, _ = value_loss(v0, old, ret, mask)
    parts = sum(
        value_loss(v0[i], old[i], ret[i], mask[i], global_token_count=int(mask.sum()))[0]
        for i in torch.arange(8).chunk(4)
    )
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)


# ----------------------------------------------------------------------------- kl and entropy


def test_kl_penalty_kinds_and_aliases():
    logp = t64([0.0, -1.0, -2.0, -30.0])
    ref = t64([-0.5, -1.0, -1.0, 0.0])
    d = (logp - ref).tolist()
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t64(d))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), t64([abs(x) for x in d]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t64([0.5 * x * x for x in d]))
    k3 = [min(10.0, max(-10.0, math.exp(-x) - (-x) - 1)) for x in d]
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t64(k3))
    assert kl_penalty(logp, ref, "k3")[3].item() == 10.0  # clamped
    for alias, kind in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        torch.testing.assert_close(kl_penalty(logp, ref, alias), kl_penalty(logp, ref, kind))
    with pytest.raises(ValueError, match="k1, kl, abs, k2, mse, k3, low_var_kl"):
        kl_penalty(logp, ref, "full")


def test_entropy_from_logits_reference_and_stability():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 3, 17, generator=gen, dtype=F64) * 3
    ent = entropy_from_logits(logits)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    assert ent.shape == (2, 3)
    # shift invariance with huge offsets in float32
    big = entropy_from_logits(logits.float() + 1e4)
    torch.testing.assert_close(big, ent.float(), atol=2e-3, rtol=0)
    # uniform over k finite entries, the rest -inf: log k, finite gradient
    z = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]], requires_grad=True)
    h = entropy_from_logits(z)
    assert h.item() == pytest.approx(math.log(3))
    h.sum().backward()
    assert torch.isfinite(z.grad).all()
    # one-hot limit: entropy 0
    assert entropy_from_logits(torch.tensor([[1e4, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)


# ----------------------------------------------------------------------------- the StarPO-S filter


def starpo_s(scores: torch.Tensor, groups: Any, value: float, keep: str = "largest") -> torch.Tensor:
    """The paper's StarPO-S filter: ``rollout.filter`` at its defaults (top_k on reward_variance)."""
    return filter_rollouts(scores, groups, "top_k", value, keep=keep).keep


def test_the_starpo_s_filter_keeps_whole_groups_top_by_std():
    # 4 groups of 3; std: g0=0, g1=1, g2=2, g3=0.5 (ids non-contiguous, interleaved)
    groups = torch.tensor([10, 11, 12, 13] * 3)
    scores = t64([5, 0, 0, 0, 5, 1, 2, 0.5, 5, 2, 4, 1])
    keep = starpo_s(scores, groups, 0.5)
    assert keep.dtype == torch.bool
    assert set(groups[keep].tolist()) == {11, 12}
    for g in groups.unique():
        assert keep[groups == g].all() or not keep[groups == g].any()
    keep_rev = starpo_s(scores, groups, 0.5, keep="smallest")
    assert set(groups[keep_rev].tolist()) == {10, 13}
    assert set(groups[starpo_s(scores, groups, 0.25)].tolist()) == {12}
    assert set(groups[starpo_s(scores, groups, 0.01)].tolist()) == {12}  # at least one group


def test_the_starpo_s_filter_value_one_ties_rounding_and_errors():
    groups = [g for g in range(8) for _ in range(4)]
    scores = torch.zeros(32)
    assert starpo_s(scores, groups, 1.0).all()
    # all stds equal: ties go to the groups that appear first
    keep = starpo_s(scores, groups, 0.25)
    assert keep.tolist() == [True] * 8 + [False] * 24
    assert starpo_s(scores, groups, 0.25, keep="smallest").tolist() == keep.tolist()
    # order of first appearance, not id value
    assert starpo_s(torch.zeros(4), ["b", "b", "a", "a"], 0.5).tolist() == [True, True, False, False]
    assert (
        int(starpo_s(torch.zeros(20), [g for g in range(10) for _ in range(2)], 0.25).sum()) == 6
    )  # 2.5 -> 3
    # group size 1: no in-group spread, unless every group is kept
    with pytest.raises(ValueError, match="needs two trajectories per group"):
        starpo_s(torch.zeros(4), [0, 1, 2, 3], 0.5)
    assert starpo_s(torch.zeros(4), [0, 1, 2, 3], 1.0).all()
    with pytest.raises(ValueError, match="largest, smallest"):
        starpo_s(scores, groups, 0.5, keep="max_mean")
    with pytest.raises(ValueError, match=r"rollout\.filter\.value\) must be in \(0, 1\]"):
        starpo_s(scores, groups, 0.0)
    with pytest.raises(ValueError, match="non-finite reward"):
        starpo_s(torch.tensor([0.0, float("inf")]), [0, 0], 0.5)
    assert starpo_s(torch.zeros(0), [], 0.5).shape == (0,)


def test_kept_group_count_rounds_the_decimal_ratio_half_up_for_every_step() -> None:
    """One rounding rule for the filter and the config check: the exact product of the ratio as
    written (a decimal) and the group count, rounded half up, at least one group."""
    for hundredths in range(1, 101):
        ratio = hundredths / 100
        for n in range(1, 1025):
            expected = max(1, math.floor(Fraction(hundredths, 100) * n + Fraction(1, 2)))
            assert kept_group_count(ratio, n) == expected, (ratio, n)
    assert kept_group_count(0.58, 25) == 15  # 0.58 * 25 == 14.499999999999998 in binary floating point
    assert kept_group_count(0.5, 0) == 0
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kept_group_count(1.5, 4)


@pytest.mark.parametrize(("ratio", "n_groups"), [(0.58, 25), (0.25, 10), (0.01, 7), (0.99, 33), (0.3, 5)])
def test_the_starpo_s_filter_keeps_kept_group_count_groups(ratio: float, n_groups: int) -> None:
    groups = [g for g in range(n_groups) for _ in range(2)]
    scores = torch.arange(2 * n_groups, dtype=torch.float64) ** 2  # distinct in-group stds
    assert int(starpo_s(scores, groups, ratio).sum()) == 2 * kept_group_count(ratio, n_groups)


def test_group_std_stats():
    stats = group_std_stats(t64([0, 2, 1, 1, 4, 6]), [0, 0, 1, 1, 2, 2])
    s = math.sqrt(2)
    assert stats["in_group_std"] == pytest.approx((s + 0 + s) / 3)
    assert stats["in_group_std_max"] == pytest.approx(s)
    assert stats["in_group_std_min"] == 0
    assert stats["in_group_max"] == pytest.approx((2 + 1 + 6) / 3)
    assert stats["in_group_mean"] == pytest.approx((1 + 1 + 5) / 3)
    assert group_std_stats(t64([3.0]), [0])["in_group_std"] == 0
    assert group_std_stats(torch.zeros(0), [])["in_group_std"] == 0
