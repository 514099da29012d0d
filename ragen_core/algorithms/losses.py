"""Losses: PPO clipped surrogate, clipped value loss, KL estimators, entropy, and loss aggregation.

The contract of these functions is summarised in docs/architecture.md, "Algorithms contract".

Token tensors have shape ``(B, T)`` with ``mask`` marking the trained tokens (bool or 0/1).
Losses keep the autograd graph; metrics are detached 0-dim tensors (the caller calls ``.item()``
once per step, avoiding a device sync per metric). An all-zero mask gives a zero loss (still
differentiable) and zero metrics.
"""

from __future__ import annotations

import torch

from ragen_core.algorithm_modes import AGG_MODES, KL_KINDS
from ragen_core.algorithms._utils import check_same_shape

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "agg_loss",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "value_loss",
]

_MAX_LOG_RATIO = 20.0  # log-ratios are clamped to ±20 before exp (as veRL) so that exp stays finite


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ m·x / Σ m over all elements; 0 when the mask is empty."""
    check_same_shape(x=x, mask=mask)
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    global_token_count: float | int | torch.Tensor | None = None,
    global_seq_count: float | int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss into a scalar.

    Why ``token-mean`` is global: docs/architecture.md, "Deliberate differences from RAGEN": loss
    aggregation.

    With m the mask, N_tok = ``global_token_count`` and N_seq = ``global_seq_count``:

        token-mean:           Σ_i Σ_t m_it·l_it / N_tok
        seq-mean-token-mean:  Σ_i [ Σ_t m_it·l_it / Σ_t m_it ] / N_seq
        seq-mean-token-sum:   Σ_i [ Σ_t m_it·l_it ] / N_seq

    Micro-batching: pass N_tok = the number of masked tokens of the whole *mini-batch* and N_seq =
    the number of its sequences that have at least one masked token; then the sum of the
    micro-batch losses equals the mini-batch loss whatever the split (RAGEN's effective per-sequence
    mean is ``seq-mean-token-mean``). When None, the counts of this tensor are used. Sequences with
    no masked token contribute 0 and are not counted. Unknown mode → ValueError.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    check_same_shape(loss_mat=loss_mat, mask=mask)
    m = mask.to(loss_mat.dtype)
    masked = torch.where(mask != 0, loss_mat, torch.zeros_like(loss_mat))  # ignores inf/NaN off-mask
    if mode == "token-mean":
        total = masked.sum()
        count = m.sum() if global_token_count is None else global_token_count
        return total / _positive(count, "global_token_count", has_items=bool(m.sum() > 0))
    tokens_per_seq = m.sum(dim=-1)
    seq_sum = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_sum = seq_sum / tokens_per_seq.clamp_min(1)
    has_tokens = tokens_per_seq > 0
    count = has_tokens.sum() if global_seq_count is None else global_seq_count
    return seq_sum.sum() / _positive(count, "global_seq_count", has_items=bool(has_tokens.any()))


def _positive(count: float | int | torch.Tensor, name: str, has_items: bool) -> float | torch.Tensor:
    """Denominator guard: an empty mask divides by 1 (loss 0); a zero count with items is an error."""
    value = float(count)
    if value <= 0:
        if has_items:
            raise ValueError(f"{name} must be positive when the mask has tokens, got {value}")
        return 1.0
    return count


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_token_count: float | int | torch.Tensor | None = None,
    global_seq_count: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher and dual clip (veRL ``compute_policy_loss``).

        ρ_t  = exp(logπ_t − logπ_old,t)                  (log-ratio clamped to ±20)
        L1   = −A_t·ρ_t
        L2   = −A_t·clip(ρ_t, 1 − ε_low, 1 + ε_high)
        Lc   = max(L1, L2)
        l_t  = min(Lc, −A_t·c) if A_t < 0 else Lc         (dual clip, c = ``dual_clip``; None disables)
        loss = agg(l, mask)                                 (see ``agg_loss``)

    Metrics (detached, masked means over this tensor's tokens):
        clipfrac        fraction with L2 > L1 (veRL pg_clipfrac)
        clipfrac_lower  fraction with A < 0 and Lc > −A·c (veRL pg_clipfrac_lower)
        approx_kl       mean(logπ_old − logπ) (veRL ppo_kl)
    """
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    if dual_clip is not None:
        loss3 = -advantages * dual_clip
        negative = advantages < 0
        loss_mat = torch.where(negative, torch.minimum(clipped, loss3), clipped)
        lower = negative & (clipped > loss3)
    else:
        loss_mat = clipped
        lower = torch.zeros_like(mask, dtype=torch.bool)
    loss = agg_loss(loss_mat, mask, agg, global_token_count, global_seq_count)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((loss2 > loss1).to(logp.dtype), mask),
            "clipfrac_lower": masked_mean(lower.to(logp.dtype), mask),
            "approx_kl": masked_mean(-log_ratio, mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    global_token_count: float | int | torch.Tensor | None = None,
    global_seq_count: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (veRL ``compute_value_loss``).

        V^clip_t = V_old,t + clip(V_t − V_old,t, −ε_v, ε_v)       (ε_v = ``clip``; None disables)
        loss     = ½ · agg(max((V_t − R_t)², (V^clip_t − R_t)²), mask)

    Metrics: vf_clipfrac = masked mean of [(V^clip − R)² > (V − R)²] (detached).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    loss1 = (values - returns) ** 2
    if clip is None:
        loss_mat, clipped = loss1, torch.zeros_like(mask, dtype=torch.bool)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss2 = (v_clipped - returns) ** 2
        loss_mat, clipped = torch.maximum(loss1, loss2), loss2 > loss1
    loss = 0.5 * agg_loss(loss_mat, mask, agg, global_token_count, global_seq_count)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean(clipped.to(values.dtype), mask)}
    return loss, {k: v.detach() for k, v in metrics.items()}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimate from sampled-token log-probs (Schulman's k1/k2/k3).

    With Δ = logπ − logπ_ref:
        k1  (alias "kl"):          Δ
        abs:                       |Δ|
        k2  (alias "mse"):         ½·Δ²
        k3  (alias "low_var_kl"):  clamp(e^{−Δ} + Δ − 1, −10, 10)   (Δ first clamped to ±20)
    Unknown kind → ValueError listing the valid ones. Masking/aggregation is the caller's (agg_loss).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    check_same_shape(logp=logp, ref_logp=ref_logp)
    delta = logp - ref_logp
    canonical = KL_KINDS[kind]
    if canonical == "k1":
        return delta
    if canonical == "abs":
        return delta.abs()
    if canonical == "k2":
        return 0.5 * delta.square()
    neg = (-delta).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log(π_ref/π)
    return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, per token.

        H = logsumexp(z) − Σ_v softmax(z)_v · z_v

    Numerically stable for large logits; entries at −inf (masked vocabulary) contribute 0.
    Shape (..., V) → (...).
    """
    probs = torch.softmax(logits, dim=-1)
    finite_logits = torch.where(probs > 0, logits, torch.zeros_like(logits))
    return torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(dim=-1)
