"""The policy under constrained action decoding: a softmax over each token's allowed ids.

Shared by the rollout engine (which samples from it) and the learner (which trains it), so that the
behaviour and the learner log-probs are one formula (docs/architecture.md, "Constrained action decoding").
"""

from __future__ import annotations

import math

import torch

from ragen_core.algorithms._utils import check_ndim

__all__ = ["restrict_to_allowed"]


def restrict_to_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits ``(N, V)`` with ``-inf`` outside each row's allowed ids ``allowed`` ``(N, K)`` (-1-padded).

    ``log_softmax`` of the result is ``z_y - logsumexp_{a in A} z_a`` for ``y`` in ``A`` (the policy
    renormalised over ``A``) and ``-inf`` elsewhere. A row whose ``allowed`` is all -1 is unconstrained
    and left as it is.
    """
    check_ndim("logits", logits, 2)
    check_ndim("allowed", allowed, 2)
    if allowed.shape[0] != logits.shape[0]:
        raise ValueError(f"allowed has {allowed.shape[0]} rows, logits {logits.shape[0]}")
    valid = allowed >= 0
    constrained = valid.any(dim=-1)
    if not bool(constrained.any()):
        return logits
    # -1 padding points at the row's first allowed id (sorted, present on constrained rows): no effect
    index = torch.where(valid, allowed, allowed[:, :1]).clamp_min(0).to(logits.device)
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    keep.scatter_(-1, index, True)
    keep |= ~constrained.to(logits.device)[:, None]
    return logits.masked_fill(~keep, -math.inf)
