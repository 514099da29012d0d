"""Collapse statistics of responses given prompts (RAGEN-2's template / entropy collapse metrics).

See docs/metrics.md, "Collapse metrics". The input is a cross log-prob matrix: row i is a sampled
response z_i, column j a prompt x_j of the sample, entry ``ℓ[i, j] = Σ_t log π(z_i,t | x_j, z_i,<t)``
(the response's summed log-prob when the policy is given prompt j instead of its own), and
``cols[i]`` the column of z_i's own prompt. The mixture over prompts is uniform over the P columns
(the batch's empirical prompt distribution), so:

- I(X; Z) ≈ mean_i [log p(z_i | x_{c_i}) − log p_mix(z_i)] with log p_mix(z) = logsumexp_j ℓ[i, j] − log P.
  Low: the response no longer depends on the prompt (template collapse); at most log P.
- H(Z | X) ≈ −mean_i log p(z_i | x_{c_i}). Low: the policy is deterministic per prompt (entropy
  collapse).
- retrieval accuracy@k: the share of responses whose own prompt is among the k columns that explain
  them best; chance is k / P.

Pure torch, no model: the model-facing part (computing ℓ) is ``ragen_core.run.collapse_probe``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ragen_core.algorithms._utils import check_finite, check_ndim

__all__ = ["RETRIEVAL_KS", "collapse_stats", "retrieval_hits"]

#: The k of RAGEN-2's retrieval accuracy@k (k = 1 is logged as ``retrieval_accuracy``).
RETRIEVAL_KS: tuple[int, ...] = (1, 2, 4, 8)


def _check(cross: torch.Tensor, cols: torch.Tensor) -> None:
    check_ndim("cross_logp", cross, 2)
    check_ndim("cols", cols, 1)
    n, p = cross.shape
    if cols.shape[0] != n:
        raise ValueError(f"cols has {cols.shape[0]} entries for {n} responses (rows of cross_logp)")
    if n and (int(cols.min()) < 0 or int(cols.max()) >= p):
        raise ValueError(
            f"cols must index the {p} prompt columns, got values in [{int(cols.min())}, {int(cols.max())}]"
        )
    check_finite(cross, "cross log-prob")


def retrieval_hits(
    cross: torch.Tensor, cols: torch.Tensor, k: int, classes: torch.Tensor | None = None
) -> torch.Tensor:
    """Per response: is its own prompt among the k best columns? ``(N,)`` bool.

        rank_i = #{j : ℓ[i, j] > ℓ[i, c_i]} + #{j < c_i : ℓ[i, j] = ℓ[i, c_i]}     (ties: lower column first)
        hit_i  = rank_i < k

    With ``classes`` (P,) (columns with equal class hold the same prompt text, e.g. two groups that
    drew the same initial state), a response is also a hit when one of its k best columns is of
    its own prompt's class: the best-ranked column of that class counts.
    """
    _check(cross, cols)
    n, p = cross.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    order = torch.arange(p, device=cross.device)
    own = cross.gather(1, cols[:, None])  # (N, 1)
    if classes is None:
        better = (cross > own) | ((cross == own) & (order[None, :] < cols[:, None]))
        return better.sum(dim=1) < k
    if classes.shape != (p,):
        raise ValueError(
            f"classes must have one entry per prompt column ({p}), got shape {tuple(classes.shape)}"
        )
    same = classes[None, :] == classes[cols][:, None]  # (N, P): columns of the own prompt's class
    # rank of column j in row i (ties: lower column first); a hit when some same-class column ranks < k
    a, b = cross[:, :, None], cross[:, None, :]
    ahead = (b > a) | ((b == a) & (order[None, None, :] < order[None, :, None]))  # [i, j, j']: j' ahead of j
    ranks = ahead.sum(dim=2)  # (N, P)
    return ((ranks < k) & same).any(dim=1)


def collapse_stats(
    cross_logp: torch.Tensor,
    n_tokens: torch.Tensor,
    cols: torch.Tensor,
    classes: torch.Tensor | None = None,
    std_eps: float = 1e-3,
    ks: Sequence[int] = RETRIEVAL_KS,
) -> dict[str, float]:
    """RAGEN-2's collapse metrics from the cross log-prob matrix (names without the ``collapse/`` prefix).

    ``cross_logp`` (N, P): summed log-prob of response i under prompt j; ``n_tokens`` (N,): the
    response's token count; ``cols`` (N,): its own prompt's column. Per-token values use
    ℓ̄[i, j] = ℓ[i, j] / max(n_i, 1) (length-normalised, as RAGEN-2's default), ``_seq`` ones ℓ itself:

        m_i = ℓ̄[i, c_i]                        q_i = logsumexp_j ℓ̄[i, j] − log P
        mi_estimate = mean(m − q)               mi_upper_bound = log P
        conditional_entropy_est = −mean(m)      reasoning_entropy_est = −mean(q)  (= H(Z|X) + I)
        marginal_std = std(q) (population)      mi_zscore = mean((m − q) / (marginal_std + std_eps))
        retrieval_accuracy@k = mean(hit@k)      retrieval_chance_level@k = min(k, P) / P
        retrieval_above_chance@k = accuracy − chance      (k = 1 without the "@1")

    With ``classes`` (see :func:`retrieval_hits`), the chance level of a response is the share of
    columns in its prompt's class (times k, at most 1), averaged over the responses. Fewer than
    two columns or no rows: ``{}`` (there is no mixture to compare with).
    """
    _check(cross_logp, cols)
    check_ndim("n_tokens", n_tokens, 1)
    n, p = cross_logp.shape
    if n_tokens.shape[0] != n:
        raise ValueError(f"n_tokens has {n_tokens.shape[0]} entries for {n} responses")
    if n == 0 or p < 2:
        return {}
    cross = cross_logp.double()
    per_token = cross / n_tokens.double().clamp_min(1)[:, None]
    rows = torch.arange(n, device=cross.device)
    out: dict[str, float] = {"mi_upper_bound": math.log(p)}
    for suffix, mat in (("", per_token), ("_seq", cross)):
        matched = mat[rows, cols]
        marginal = torch.logsumexp(mat, dim=1) - math.log(p)
        gap = matched - marginal
        std = marginal.std(unbiased=False) if n > 1 else torch.zeros((), dtype=mat.dtype)
        out[f"mi{suffix}_estimate"] = float(gap.mean())
        out[f"conditional_entropy{suffix}_est"] = float(-matched.mean())
        out[f"reasoning_entropy{suffix}_est"] = float(-marginal.mean())
        out[f"marginal_std{suffix}"] = float(std)
        out[f"mi_zscore{suffix}"] = float((gap / (std + std_eps)).mean())
    if classes is None:
        share = torch.full((n,), 1.0 / p, dtype=torch.float64)
    else:
        counts = (classes[None, :] == classes[:, None]).sum(dim=1).double()  # per column: its class size
        share = counts[cols] / p
    for k in ks:
        k_eff = min(int(k), p)
        acc = float(retrieval_hits(per_token, cols, k_eff, classes).double().mean())
        chance = float((share * k_eff).clamp(max=1.0).mean())
        tag = "" if k == 1 else f"@{k}"
        out[f"retrieval_accuracy{tag}"] = acc
        out[f"retrieval_chance_level{tag}"] = chance
        out[f"retrieval_above_chance{tag}"] = acc - chance
    return out
