"""The learner's batch: a trajectory table as right-padded tensors (:class:`TokenBatch`,
:func:`to_token_batch`), and the checks a batch must pass before an update (:func:`check_batch`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from ragen_core.config.learner import LearnerConfig


class BadBatchError(ValueError):
    """A batch the learner cannot train on; the message says what is wrong and how to fix it."""


@dataclass
class TokenBatch:
    """The learner's view of a trajectory table: right-padded tensors, one row per trajectory."""

    input_ids: torch.Tensor  # (B, L) int64, pad 0
    attention_mask: torch.Tensor  # (B, L) int64
    loss_mask: torch.Tensor  # (B, L) float32: 1 on sampled (trained) tokens
    turn_index: torch.Tensor  # (B, L) int64
    rollout_logprobs: torch.Tensor  # (B, L) float32, 0 outside the loss mask
    scores: torch.Tensor  # (B,) float32
    group_ids: torch.Tensor  # (B,) int64
    #: (B, K) float32: env reward + format penalty of each *trained* assistant turn, 0-padded
    #: (bi-level GAE; column k is the k-th trained turn of the row)
    turn_scores: torch.Tensor | None = None
    #: (B,) the environment tag of each row (reward normalisation with grouping ``inductive``)
    env_tags: tuple[str, ...] | None = None
    #: (B, L, K) int64: the token ids each token was sampled among under constrained decoding, -1-padded;
    #: a position whose row is all -1 was sampled from the whole vocabulary. None: no constrained token
    allowed_token_ids: torch.Tensor | None = None
    #: (B, L) int64: which of its row's sequences each token belongs to, -1 on padding; a row trained
    #: turn by turn (``agent.window_training: every_turn``) holds one sequence per turn, each run on its
    #: own. None: every row is one sequence
    segments: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _pad(rows: Sequence[Sequence[float | int]], length: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros((len(rows), length), dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def to_token_batch(table: pa.Table | Mapping[str, Sequence[Any]]) -> TokenBatch:
    """Right-padded tensors from a trajectory table (or its ``to_pydict()``)."""
    cols = table.to_pydict() if isinstance(table, pa.Table) else table
    ids = cols["input_ids"]
    length = max((len(r) for r in ids), default=0)
    lengths = torch.tensor([len(r) for r in ids], dtype=torch.int64)
    attention = (torch.arange(length)[None, :] < lengths[:, None]).long()
    infos = _info(cols)  # parsed once: the turn scores and the allowed ids both read it
    return TokenBatch(
        input_ids=_pad(ids, length, torch.int64),
        attention_mask=attention,
        loss_mask=_pad(cols["loss_mask"], length, torch.float32),
        turn_index=_pad(cols["turn_index"], length, torch.int64),
        rollout_logprobs=_pad(cols["rollout_logprobs"], length, torch.float32),
        scores=torch.tensor(cols["score"], dtype=torch.float32),
        group_ids=torch.tensor(cols["group_id"], dtype=torch.int64),
        turn_scores=_turn_scores(cols["turn_rewards"], infos) if "turn_rewards" in cols else None,
        env_tags=tuple(cols["env_tag"]) if "env_tag" in cols else None,
        allowed_token_ids=_allowed_token_ids(infos, length),
        segments=_segments(infos, lengths, length),
    )


def _segments(infos: Sequence[dict[str, Any]], lengths: torch.Tensor, length: int) -> torch.Tensor | None:
    """Each token's sequence number within its row (``info["segment_starts"]``), -1 on padding; None when
    no row holds more than one sequence."""
    starts = [meta.get("segment_starts") or [0] for meta in infos]
    if all(len(s) <= 1 for s in starts):
        return None
    out = torch.full((len(starts), length), -1, dtype=torch.int64)
    for i, (row, n) in enumerate(zip(starts, lengths.tolist(), strict=True)):
        bounds = [*row, n]
        for k in range(len(row)):
            out[i, bounds[k] : bounds[k + 1]] = k
    return out


def _info(cols: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    infos = cols.get("info") or [None] * len(cols["input_ids"])
    return [json.loads(i) if isinstance(i, str) and i else (i or {}) for i in infos]


def _allowed_token_ids(infos: Sequence[dict[str, Any]], length: int) -> torch.Tensor | None:
    """The constrained tokens' allowed ids (``info["allowed_token_ids"]``: ``[position, ids]`` pairs) as
    a ``(B, length, K)`` tensor padded with -1; None when no row has any (free decoding)."""
    rows = [meta.get("allowed_token_ids") or [] for meta in infos]
    width = max((len(ids) for row in rows for _, ids in row), default=0)
    if width == 0:
        return None
    out = torch.full((len(rows), length, width), -1, dtype=torch.int64)
    for i, row in enumerate(rows):
        for pos, ids in row:
            out[i, pos, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return out


def _turn_scores(turn_rewards: Sequence[Sequence[float]], infos: Sequence[dict[str, Any]]) -> torch.Tensor:
    """Per trained turn: its env reward plus its format penalty (turns outside the context window
    were not trained and are left out)."""
    rows = []
    for rewards, meta in zip(turn_rewards, infos, strict=True):
        penalties = meta.get("turn_penalties") or [0.0] * len(rewards)
        first = int(meta.get("first_trained_turn", 0))
        rows.append([r + p for r, p in zip(rewards, penalties, strict=True)][first:])
    return _pad(rows, max((len(r) for r in rows), default=0), torch.float32)


def check_batch(
    batch: TokenBatch, turn_scores: torch.Tensor | None, cfg: LearnerConfig, vocab: int | None
) -> None:
    """Raise :class:`BadBatchError` naming the first thing that keeps ``batch`` (and its ``turn_scores``)
    from an update under ``cfg``; ``vocab`` is the policy's vocabulary size (None: not checked)."""
    n = _check_shapes(batch)
    _check_tokens(batch, vocab)
    _check_for_config(batch, turn_scores, cfg, n)


def _check_shapes(batch: TokenBatch) -> int:
    """Every field present, at least one row, token tensors ``(B, L)``, per-row ones ``(B,)``, finite
    scores; the number of rows."""
    names = ("input_ids", "attention_mask", "loss_mask", "turn_index", "scores", "group_ids")
    missing = [n for n in names if getattr(batch, n, None) is None]
    if missing:
        raise BadBatchError(f"batch lacks {missing}; pass a ragen_core.learner.batch.TokenBatch")
    n = int(batch.input_ids.shape[0]) if batch.input_ids.dim() >= 1 else 0
    if n == 0:
        raise BadBatchError(
            "0 trajectories after filtering: nothing to train on. Keep more groups (raise "
            "rollout.filter.value, the fraction of groups kept) or raise the number of env groups"
        )
    token_fields = ["input_ids", "attention_mask", "loss_mask", "turn_index"]
    for optional in ("rollout_logprobs", "segments"):
        if getattr(batch, optional, None) is not None:
            token_fields.append(optional)
    shapes = {f: tuple(getattr(batch, f).shape) for f in token_fields}
    shapes.update({f: tuple(getattr(batch, f).shape) for f in ("scores", "group_ids")})
    if (
        batch.input_ids.dim() != 2
        or any(shapes[f] != shapes["input_ids"] for f in token_fields)
        or any(shapes[f] != (n,) for f in ("scores", "group_ids"))
    ):
        listed = ", ".join(f"{k} {v}" for k, v in shapes.items())
        raise BadBatchError(
            f"batch tensors disagree in shape: {listed}; token tensors must all be (B, L) and "
            "scores / group_ids (B,)"
        )
    bad = ~torch.isfinite(batch.scores.double())
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()[:20]
        raise BadBatchError(
            f"non-finite reward (score) in trajectories {rows}: check the environment's rewards and the "
            "format penalty of these rows"
        )
    return n


def _check_tokens(batch: TokenBatch, vocab: int | None) -> None:
    """Right-padded attention, trained tokens inside it (never the first), in every row, inside the
    vocabulary."""
    loss_mask = batch.loss_mask != 0
    attention = batch.attention_mask != 0
    if bool((attention[:, 1:] & ~attention[:, :-1]).any()):
        raise BadBatchError("attention_mask must be right-padded (ones, then zeros) in every row")
    if bool((loss_mask & ~attention).any()):
        raise BadBatchError("loss_mask has trained tokens on padding (attention_mask 0)")
    if bool(loss_mask[:, 0].any()):
        raise BadBatchError("loss_mask[:, 0] must be 0: the first token has no context to be sampled from")
    segments = getattr(batch, "segments", None)
    if segments is not None:
        opens = torch.zeros_like(loss_mask)
        opens[:, 1:] = (segments[:, 1:] != segments[:, :-1]) & attention[:, 1:]
        if bool((opens & loss_mask).any()):
            raise BadBatchError(
                "a row's sequence (info['segment_starts']) starts with a trained token, which has no "
                "context to be sampled from: each turn's sequence must start with its prompt"
            )
    empty = torch.nonzero(~loss_mask.any(dim=1)).flatten().tolist()
    if empty:
        raise BadBatchError(
            f"trajectories {empty[:20]} have no trained token (loss_mask all 0): drop them before the learner"
        )
    if vocab is not None:
        ids = batch.input_ids[attention]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise BadBatchError(
                f"input_ids outside the policy's vocabulary [0, {vocab}): min {int(ids.min())}, "
                f"max {int(ids.max())}; was the batch made with another tokenizer?"
            )


def _check_for_config(
    batch: TokenBatch, turn_scores: torch.Tensor | None, cfg: LearnerConfig, n: int
) -> None:
    """What ``cfg`` needs of a batch of ``n`` rows: enough rows for a mini-batch, turn scores, env tags."""
    if cfg.optim.mini_batch_size > n:
        raise BadBatchError(
            f"optim.mini_batch_size={cfg.optim.mini_batch_size} is larger than the {n} trajectories "
            f"of this batch (after filtering): set optim.mini_batch_size <= {n}, or keep more "
            "trajectories (raise rollout.filter.value, env groups or group size)"
        )
    alg = cfg.algorithm
    if alg.use_turn_scores and turn_scores is None:
        raise BadBatchError(
            "algorithm.use_turn_scores=true needs the batch's turn_scores (to_token_batch makes them from "
            "the trajectory table's turn_rewards); pass them or set use_turn_scores false"
        )
    norm = alg.reward_normalization
    if norm.active and norm.grouping == "inductive":
        tags = getattr(batch, "env_tags", None)
        if tags is None or len(tags) != n:
            raise BadBatchError(
                "algorithm.reward_normalization.grouping=inductive needs the batch's env_tags, one per "
                f"trajectory (got {None if tags is None else len(tags)} for {n}); build the batch with "
                "to_token_batch from a table with env_tag"
            )
    if turn_scores is not None and (alg.bi_level_gae or alg.use_turn_scores):
        if turn_scores.dim() != 2 or turn_scores.shape[0] != n:
            raise BadBatchError(f"turn_scores must be (B={n}, K), got {tuple(turn_scores.shape)}")
        bad = ~torch.isfinite(turn_scores.double())
        if bool(bad.any()):
            rows = torch.nonzero(bad.any(dim=1)).flatten().tolist()[:20]
            raise BadBatchError(f"non-finite reward (turn_scores) in trajectories {rows}")
