"""The learner's data-parallel group (``torch.distributed``): each rank's contiguous share of the
rows, parameters broadcast from rank 0, gradients summed over the ranks.

Every learner of a group holds the whole batch and the same weights; each computes on its share of
the rows and the all-reduce makes every rank take the same optimiser step (docs/architecture.md,
"Learner step"; ``ragen_core.learner.actors`` builds the group).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["allreduce_grads", "broadcast_parameters", "split"]


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous near-equal ranges covering range(n)."""
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def broadcast_parameters(*modules: nn.Module | None) -> None:
    """Every parameter and buffer of ``modules`` (None skipped) from rank 0 to the other ranks."""
    for module in modules:
        if module is None:
            continue
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)


def allreduce_grads(params: list[nn.Parameter], bucket_elems: int = 2**25) -> None:
    """Sum gradients over the data-parallel group (flat buckets; a missing grad counts as 0)."""
    bucket: list[nn.Parameter] = []
    size = 0
    for p in [*params, None]:
        if p is not None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            bucket.append(p)
            size += p.numel()
        if bucket and (p is None or size >= bucket_elems):
            flat = torch.cat([cast(torch.Tensor, q.grad).reshape(-1) for q in bucket])  # grads set above
            dist.all_reduce(flat)
            offset = 0
            for q in bucket:
                grad = cast(torch.Tensor, q.grad)
                grad.copy_(flat[offset : offset + q.numel()].view_as(grad))
                offset += q.numel()
            bucket, size = [], 0
