"""Dropping what old checkpoints hold (``trainer.keep_optimizer_states``, ``trainer.keep_policies``): each
removal leaves a note with its reason first, which :func:`~ragen_core.learner.checkpoint.verify_checkpoint`
and every load name, so a pruned checkpoint is never taken for a damaged one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ragen_core.learner.checkpoint import MANIFEST, OPTIM_PRUNED, WEIGHTS_PRUNED
from ragen_core.storage import write_text_whole


def _leave_note(path: Path, name: str, reason: str) -> None:
    """Write the note ``name`` (its text: ``reason``) into checkpoint folder ``path`` in one rename. It is
    written before anything is removed, so a crash halfway leaves a folder that says what happened, never
    one that looks loadable."""
    write_text_whole(path / name, reason.rstrip() + "\n")


def prune_optimizer_state(path: str | os.PathLike[str], reason: str) -> bool:
    """Remove a checkpoint's ``optim.pt`` (AdamW keeps two tensors per weight: twice the policy's size),
    leaving ``OPTIM_PRUNED`` with ``reason``; the weights, the RNG states and the manifest stay, and
    ``verify_checkpoint`` still checks them. Returns whether anything was removed."""
    path = Path(path)
    optim = path / "optim.pt"
    if not optim.exists():
        return False
    _leave_note(path, OPTIM_PRUNED, reason)
    optim.unlink()
    return True


def prune_weights(path: str | os.PathLike[str], reason: str) -> bool:
    """Remove a checkpoint's weights (``policy/``, ``critic.safetensors``) and ``optim.pt``, leaving
    ``WEIGHTS_PRUNED`` with ``reason``; the manifest and RNG states stay as the record of the step. From
    then on :func:`verify_checkpoint` (so every load) names the note. Returns whether anything was
    removed."""
    path = Path(path)
    if not (path / MANIFEST).is_file() or (path / WEIGHTS_PRUNED).exists():
        return False
    _leave_note(path, WEIGHTS_PRUNED, reason)
    shutil.rmtree(path / "policy", ignore_errors=True)
    for name in ("critic.safetensors", "optim.pt", OPTIM_PRUNED):
        (path / name).unlink(missing_ok=True)
    return True
