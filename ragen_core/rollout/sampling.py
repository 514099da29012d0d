"""Turning next-token logits into a draw: temperature / top-k / top-p filtering, the restriction to
allowed ids under constrained decoding, and the seeded inverse-CDF draw of :class:`HFEngine`
(:mod:`ragen_core.rollout.hf_engine`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ragen_core.algorithms.constrained import restrict_to_allowed


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling distribution (rows sum to 1) after temperature, top-k, then top-p (nucleus)."""
    x = logits / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        remove = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(remove, 0.0)
        sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return probs


def restrict_logits(logits: torch.Tensor, allowed: Sequence[Sequence[int] | None]) -> torch.Tensor:
    """``logits`` with ``-inf`` outside each row's allowed ids (``None``: the row is free), the same
    renormalised policy the learner trains (``algorithms.restrict_to_allowed``)."""
    if all(a is None for a in allowed):
        return logits
    width = max(len(a) for a in allowed if a is not None)
    table = torch.full((len(allowed), width), -1, dtype=torch.long)
    for row, ids in enumerate(allowed):
        if ids is not None:
            table[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    return restrict_to_allowed(logits, table)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row: the first index whose cumulative mass exceeds ``u * total`` (u in [0, 1))."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (uniforms.double().to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)
