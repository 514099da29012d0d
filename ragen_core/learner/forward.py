"""The learner's forward passes: log-probs (and entropies) of the trained tokens, critic values, and
running a no-grad pass over a data-parallel rank's share of the rows.

Token alignment (docs/architecture.md, "Trajectory schema"): ``loss_mask[b, t] = 1`` says token t
was sampled by the policy. Its log-prob and its value come from the model's output at position t - 1
(the state before the token was chosen); every per-token tensor here is indexed by the *target*
position t, and position 0 (nothing before it) is never trained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ragen_core.algorithms import restrict_to_allowed
from ragen_core.learner.critic import ValueModel, backbone
from ragen_core.learner.parallel import split
from ragen_core.models.policies import cache_kwarg

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "RowSequences",
    "StepTensors",
    "decoder_hidden",
    "infer_rows",
    "prompt_response_rows",
    "rows_of",
    "shared_prefix_length",
    "to_targets",
    "token_logprobs",
    "token_values",
]


@dataclass
class StepTensors:
    """The per-token tensors of one step (trimmed to the batch's longest row, on the learner's
    device), shared by its updates and its metrics."""

    input_ids: torch.Tensor  # (B, L) int64
    mask: torch.Tensor  # (B, L) bool: trained target tokens
    lengths: torch.Tensor  # (B,) tokens per row (attention mask sum)
    old_logp: torch.Tensor  # (B, L) log-probs before the update (filled by it with old_logp_from_update)
    ref_logp: torch.Tensor | None  # (B, L) reference policy's log-probs, only with a KL term
    values: torch.Tensor | None  # (B, L) critic values before the update, only with a critic
    returns: torch.Tensor  # (B, L) critic targets
    advantages: torch.Tensor  # (B, L)
    old_logp_from_update: bool  # the single update's own forward pass fills old_logp
    allowed: torch.Tensor | None = None  # (B, L, K) constrained tokens' allowed ids, -1-padded
    segments: torch.Tensor | None = None  # (B, L) each token's sequence in its row (turn-by-turn rows)


#: Decoder families whose logits are exactly ``lm_head(last_hidden_state)`` (no soft-capping or
#: scaling): the learner applies the head only to trained positions.
_HEAD_ONLY_ON_MASK = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _scatter_targets(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Values of the trained targets (in ``mask[:, 1:]`` order) -> (b, l) by target position, 0 elsewhere."""
    out = values.new_zeros(mask.shape)
    out[:, 1:][mask[:, 1:]] = values
    return out


def to_targets(per_position: torch.Tensor) -> torch.Tensor:
    """Shift outputs at positions 0..L-2 to target positions 1..L-1; target 0 gets 0."""
    x = per_position[:, :-1]
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)


class RowSequences:
    """The sequences packed in a batch's rows (a row trained turn by turn holds one per turn, each its own
    prompt and answer), as index tensors: :meth:`pack` lays them out one per row, each from position 0,
    and :meth:`unpack` puts per-token results back where their tokens are. Running the packed rows is
    running each sequence on its own: no token attends to another sequence's, and positions restart."""

    def __init__(self, segments: torch.Tensor) -> None:
        seg = segments.cpu()
        rows, cols = torch.nonzero(seg >= 0, as_tuple=True)
        key = rows * (int(seg.max()) + 1) + seg[rows, cols]
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]  # nonzero is row-major and a row's sequences are contiguous
        packed_row = torch.cumsum(first.long(), dim=0) - 1
        start = cols[first][packed_row]
        dev = segments.device
        self.rows, self.cols = rows.to(dev), cols.to(dev)
        self.packed_row, self.offset = packed_row.to(dev), (cols - start).to(dev)
        self.n = int(first.sum())
        self.width = int(self.offset.max()) + 1 if self.n else 0

    @staticmethod
    def of(segments: torch.Tensor | None) -> RowSequences | None:
        """The index of ``segments`` (b, l); None when no row holds more than one sequence."""
        if segments is None or int(segments.max()) < 1:
            return None
        return RowSequences(segments)

    def pack(self, x: torch.Tensor, fill: float | bool) -> torch.Tensor:
        """(b, l, ...) -> (sequences, longest sequence, ...), ``fill`` after each sequence's end."""
        out = x.new_full((self.n, self.width, *x.shape[2:]), fill)
        out[self.packed_row, self.offset] = x[self.rows, self.cols]
        return out

    def unpack(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """(sequences, longest sequence) -> ``shape`` (b, l), 0 on padding; gradients flow through."""
        out = y.new_zeros(shape)
        out[self.rows, self.cols] = y[self.packed_row, self.offset]
        return out


def rows_of(x: torch.Tensor | None, rows: torch.Tensor | slice, width: int) -> torch.Tensor | None:
    """``x[rows, :width]``, for the optional per-token tensors (allowed ids, segments); None stays None."""
    return None if x is None else x[rows, :width]


#: a shared prefix shorter than this is not worth a second forward pass
MIN_SHARED_PREFIX = 8


def shared_prefix_length(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> int:
    """How many leading tokens :func:`decoder_hidden` may run once for the whole batch: the tokens equal
    (and attended, given ``attention_mask``) in every row, up to the first position whose hidden state
    a trained token needs (those come out of the second pass); 0 for a single row or a prefix under
    ``MIN_SHARED_PREFIX`` tokens (nothing to gain)."""
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(dim=0)
    if attention_mask is not None:
        same &= (attention_mask == 1).all(dim=0)
    p = int(same.long().cumprod(dim=0).sum())
    needed = loss_mask[:, 1:].any(dim=0).nonzero()
    if len(needed):
        p = min(p, int(needed[0]))
    return p if p >= MIN_SHARED_PREFIX else 0


def decoder_hidden(
    decoder: Any, input_ids: torch.Tensor, prefix: int = 0, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The decoder's last hidden states at positions ``prefix`` .. L - 1, shape (b, L - prefix, h).

    ``prefix`` > 0 (:func:`shared_prefix_length`): the first ``prefix`` tokens, the same in every row (a
    multi-turn batch's system prompt and instruction), run once; their key/value cache is repeated over
    the rows and the rest runs on top of it. Gradients flow through the cache into that pass, so the
    states and their gradients are the plain pass's up to float rounding, for about the cost of the
    rows' own tokens.
    """
    if prefix == 0:
        plain: torch.Tensor = decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return plain
    from transformers import DynamicCache

    cache_kw = cache_kwarg(decoder)
    cache = DynamicCache(config=decoder.config)
    decoder(input_ids=input_ids[:1, :prefix], use_cache=True, **{cache_kw: cache})
    cache.batch_repeat_interleave(input_ids.shape[0])
    positions = torch.arange(prefix, input_ids.shape[1], device=input_ids.device)
    hidden: torch.Tensor = decoder(
        input_ids=input_ids[:, prefix:],
        attention_mask=attention_mask,
        position_ids=positions.expand(input_ids.shape[0], -1),
        use_cache=True,
        **{cache_kw: cache},
    ).last_hidden_state
    return hidden


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    autocast: AbstractContextManager[object],
    with_entropy: bool = False,
    entropy_grad: bool = True,
    allowed: torch.Tensor | None = None,
    shared_prefix: bool = False,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of each trained target token t from the output at t - 1, shape (b, l).

    ``segments`` (b, l): rows that hold several sequences (:class:`RowSequences`) run each on its own.

    ``allowed`` (b, l, K): for tokens sampled under constrained decoding, the ids they were sampled
    among (-1-padded; all -1 elsewhere). Their distribution is the softmax over those ids alone,
    ``log pi_c(y) = z_y - logsumexp_{a in A} z_a``, and so is their entropy: the policy that played.

    Zero outside ``mask``. For the decoder families of ``_HEAD_ONLY_ON_MASK`` the LM head and
    the softmax run only on the trained positions (environment and prompt tokens need no
    vocabulary distribution); other models compute full logits. The entropy comes from the same
    log-softmax, H = -sum_v p_v log p_v (equal to ``algorithms.entropy_from_logits``, sharing the
    log-softmax's backward). The forward pass runs inside ``autocast``; with ``shared_prefix`` (those
    families only) the rows' common leading tokens run once (:func:`decoder_hidden`).
    """
    packed = RowSequences.of(segments)
    if packed is not None:
        logp_p, entropy_p = token_logprobs(
            model,
            packed.pack(input_ids, 0),
            packed.pack(mask, False),
            autocast,
            with_entropy,
            entropy_grad,
            None if allowed is None else packed.pack(allowed, -1),
            shared_prefix,
        )
        unpacked = None if entropy_p is None else packed.unpack(entropy_p, mask.shape)
        return packed.unpack(logp_p, mask.shape), unpacked
    targets = mask[:, 1:]
    with autocast:
        if _model_type(model) in _HEAD_ONLY_ON_MASK:
            p = shared_prefix_length(input_ids, mask) if shared_prefix else 0
            hidden = decoder_hidden(backbone(model), input_ids, p)
            logits = cast("PreTrainedModel", model).get_output_embeddings()(hidden[:, :-1][targets[:, p:]])
        else:
            logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1][targets]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if allowed is not None:
        logits = restrict_to_allowed(logits, allowed[:, 1:][targets])
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:][targets][:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            src = logp_all if entropy_grad else logp_all.detach()
            finite = src.clamp_min(torch.finfo(src.dtype).min)  # p = 0 where log p = -inf: 0, not NaN
            entropy = _scatter_targets(-(src.exp() * finite).sum(dim=-1), mask)
    return _scatter_targets(logp, mask), entropy


def token_values(
    critic: ValueModel,
    input_ids: torch.Tensor,
    autocast: AbstractContextManager[object],
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """The critic's value of each target position (from the output before it), (b, l), float32 at least;
    rows of several sequences (``segments``, :class:`RowSequences`) run each on its own."""
    packed = RowSequences.of(segments)
    if packed is not None:
        return packed.unpack(token_values(critic, packed.pack(input_ids, 0), autocast), input_ids.shape)
    with autocast:
        values = critic(input_ids)
    return to_targets(values.float() if values.dtype in (torch.bfloat16, torch.float16) else values)


@torch.no_grad()
def infer_rows(
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor],
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    dtype: torch.dtype,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    allowed: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``fn(ids, mask, allowed, segments) -> (b, l)`` over rank ``rank``'s contiguous share of the
    rows in micro-batches (each trimmed to its longest row; ``allowed``, ``segments``: the rows' slices
    of them, or None), then all-reduce, so every rank holds the whole (B, L) result."""
    batch, length = input_ids.shape
    out = torch.zeros(batch, length, dtype=dtype, device=input_ids.device)
    lo, hi = split(batch, world_size)[rank]
    for start in range(lo, hi, micro_batch_size):
        end = min(start + micro_batch_size, hi)
        width = int(lengths[start:end].max())
        part, seg = rows_of(allowed, slice(start, end), width), rows_of(segments, slice(start, end), width)
        out[start:end, :width] = fn(input_ids[start:end, :width], mask[start:end, :width], part, seg).to(
            dtype
        )
    if world_size > 1:
        dist.all_reduce(out)
    return out


def prompt_response_rows(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, mask, lengths)`` of every response after every prompt, row ``i * P + j`` for
    response i after prompt j, right-padded with 0; ``mask`` marks the response's tokens (on the CPU)."""
    seqs = [(list(x) + list(z), len(x)) for z in responses for x in prompts]
    lengths = torch.tensor([len(s) for s, _ in seqs], dtype=torch.int64)
    width = int(lengths.max())
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, (s, start) in enumerate(seqs):
        input_ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, start : len(s)] = True
    return input_ids, mask, lengths
