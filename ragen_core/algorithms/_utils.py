"""Input checks and group bookkeeping shared by the algorithm modules (private)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming every tensor and its shape unless all shapes are equal."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: {listed}")


def check_ndim(name: str, x: torch.Tensor, ndim: int) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def check_finite(x: torch.Tensor, what: str, where: torch.Tensor | None = None) -> None:
    """Raise ValueError listing the trajectories (rows) where ``x`` is NaN or infinite.

    ``where`` (same shape as ``x``) restricts the check to the positions that are used.
    """
    bad = ~torch.isfinite(x)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=1) if bad.dim() > 1 else bad
        idx = torch.nonzero(rows).flatten().tolist()
        shown = idx[:20] + (["..."] if len(idx) > 20 else [])
        raise ValueError(f"non-finite {what} in trajectories {shown}")


def as_float(x: torch.Tensor) -> torch.Tensor:
    """Floating tensors unchanged; integer/bool tensors cast to the default float dtype."""
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def group_index(group_ids: torch.Tensor | Sequence[Hashable], n: int) -> tuple[torch.Tensor, int]:
    """Map per-trajectory group ids to dense indices 0..G-1, numbered by order of first appearance.

    ``group_ids`` may be a 1-D tensor / array of ints or any sequence of hashables (e.g. uid strings).
    Returns ``(index LongTensor of shape (n,), G)``.
    """
    ids = group_ids.tolist() if hasattr(group_ids, "tolist") else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"shape mismatch: scores ({n},), group_ids ({len(ids)},)")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


def group_moments(
    scores: torch.Tensor, index: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (count, mean, unbiased std) of 1-D ``scores``; std is NaN for a group of size 1."""
    index = index.to(scores.device)
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, index, torch.ones_like(scores)
    )
    mean = torch.zeros_like(count).index_add_(0, index, scores) / count
    sq = torch.zeros_like(count).index_add_(0, index, (scores - mean[index]) ** 2)
    std = torch.sqrt(sq / (count - 1))  # NaN (0/0) or inf for a group of size 1
    std = torch.where(count > 1, std, torch.full_like(std, float("nan")))
    return count, mean, std
