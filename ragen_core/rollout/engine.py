"""Rollout engines: batched sampling over token-id prompts (token-in, token-out).

An engine takes prompts as lists of token ids and returns, for each, the sampled token ids, the
log-probability of each sampled token, and why generation stopped. Nothing is decoded or
re-encoded here: the ids are exactly what the trainer will train on.

Log-prob convention (shared by every backend): ``Generation.logprobs[j]`` is
``log_softmax(logits_j)[token_j]`` over the *full* vocabulary of the *raw* next-token logits,
i.e. at temperature 1 with no top-k/top-p filtering, computed in float32. That is exactly what the
learner recomputes as the old (behaviour) log-probs, so for a float32 model the two agree to
float rounding (about 1e-5); with bf16 or a different backend their gap is a logged metric.
Sampling itself uses the requested temperature / top-k / top-p; with temperature != 1 the stored
values are therefore *not* the log-probs of the distribution actually sampled from (RAGEN's
learner also uses temperature-1 log-probs).

:class:`HFEngine` is the CPU default: a hand-written decode loop over a transformers causal LM with
a KV cache (not ``model.generate``), so that the per-token log-probs and the random stream are
under our control:

* left padding, ``attention_mask``, and ``position_ids = cumsum(mask) - 1`` clamped at 0, the same
  positions the learner uses, so each sequence sees exactly the positions it would see alone;
* seeded sampling with one random stream per sequence: the token sampled at step ``t`` of sequence
  ``i`` is an inverse-CDF draw with the ``t``-th uniform of ``torch.Generator(seed_i)``. The random
  stream is therefore independent of the batch composition and of micro-batching; the logits
  themselves can differ at float-rounding level between batch shapes, which flips a draw only in
  vanishingly rare ties;
* generation stops at a stop token (default: the tokenizer's eos, ``<|im_end|>`` for ChatML),
  which is included in the output (``finish_reason="stop"``), or after ``max_new_tokens`` or at
  the model's context length (``finish_reason="length"``);
* finished sequences are dropped from the batch and the KV cache, so they stop costing compute;
* the prompt pass (prefill) computes identical prompts once (a group's members at their first
  turn), runs the distinct prompts sorted by length in chunks of similar length (little padding;
  no attention mask at all when a chunk's lengths are equal), and writes the keys/values into a
  preallocated buffer that each decode step extends in place, instead of HF's ``DynamicCache``
  concatenating the whole cache at every token;
* inside :meth:`RolloutEngine.conversations` (the runner opens it around one episode batch), each
  finished sequence's keys and values are kept, and a later prompt that extends a kept sequence
  (the next turn: the same conversation plus the environment's reply) prefills only its new
  tokens on top of them, as vLLM's prefix caching does. Keys are cached after the rotary
  embedding of their own positions, which a continuation shares, so reuse changes nothing but
  float rounding. Outside that scope nothing is kept (the weights may change between calls).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ragen_core.algorithms.constrained import restrict_to_allowed

if TYPE_CHECKING:
    from ragen_core.rollout.constrained import AnswerConstraint

FinishReason = Literal["stop", "length"]


class PromptTooLongError(ValueError):
    """A prompt that leaves no room for even one new token in the model's context."""


class SamplingParams(BaseModel):
    """Per-call sampling settings (vLLM's names and meanings).

    ``temperature=0`` (or ``top_k=1``) is greedy decoding. ``top_k=-1`` and ``top_p=1`` turn those
    filters off. ``stop_token_ids=None`` uses the engine's default stop ids (the tokenizer's eos).
    ``seed`` seeds sequence ``i`` with ``seed + i`` when no per-sequence seeds are passed to
    :meth:`RolloutEngine.generate`; ``None`` draws seeds from torch's global RNG.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_new_tokens: int = Field(default=400, ge=1)
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {v}")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class Generation:
    """One sampled continuation: ids (stop token included), their raw log-probs, and why it ended."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    #: per token, the ids it was sampled among under constrained decoding (``None``: the whole
    #: vocabulary); empty when the call had no constraints. ``logprobs`` are then renormalised over them.
    allowed: list[tuple[int, ...] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


class RolloutEngine(ABC):
    """What the rollout runner needs from a generation backend (HF here, vLLM on GPUs)."""

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt (token ids, no decoding); same seeds, same tokens.

        Engines that support constrained action decoding take a keyword ``constraints``: one
        :class:`~ragen_core.rollout.constrained.AnswerConstraint` (or ``None``) per prompt; the runner
        passes it only when the config asks for constrained decoding.
        """

    @abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (a full state dict, parameter names as in the HF model)."""

    @abstractmethod
    def close(self) -> None:
        """Release the model and any worker processes."""

    @contextlib.contextmanager
    def conversations(self) -> Iterator[None]:
        """Scope in which successive ``generate`` calls continue the same conversations (one
        rollout: no weight update inside), so an engine may reuse work across them. No-op here."""
        yield

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve_seeds(n: int, params: SamplingParams, seeds: Sequence[int] | None) -> list[int]:
    """Per-sequence seeds: explicit ``seeds``, else ``params.seed + i``, else from torch's global RNG."""
    if seeds is not None:
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} prompts; pass one seed per prompt")
        return [int(s) for s in seeds]
    if params.seed is not None:
        return [params.seed + i for i in range(n)]
    return torch.randint(0, 2**62, (n,)).tolist()


def check_prompts(prompts: Sequence[Sequence[int]], max_model_len: int, vocab_size: int) -> None:
    """Every prompt non-empty, in the vocabulary, and leaving room for one new token (else a clear error)."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(p) >= max_model_len:
            raise PromptTooLongError(
                f"prompt {i} has {len(p)} tokens but the model context is {max_model_len} tokens, "
                "leaving no room to generate; shorten the prompt (e.g. max_context_window), raise "
                "rollout.max_model_len, or use a model with a longer context"
            )
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside [0, {vocab_size})")


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


class HFEngine(RolloutEngine):
    """Rollout engine over a transformers causal LM, with a KV-cached decode loop.

    ``model`` is used in place (``update_weights`` writes into it; an in-process learner may share
    it). ``tokenizer`` supplies the pad id and default stop ids; both can be given explicitly.
    ``max_model_len`` (default ``config.max_position_embeddings``) bounds prompt + generation;
    a prompt that does not fit raises :class:`PromptTooLongError` (never a silent cut).
    ``max_batch_size`` splits large calls into micro-batches (results do not depend on it, up to
    float rounding of the logits). ``prefill_tokens`` bounds the padded tokens of one prefill
    forward pass (prompts are chunked by length; a longer prompt gets a pass of its own).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_model_len: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int | None = None,
        prefill_tokens: int = 8192,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        cfg = model.config
        ctx = getattr(cfg, "max_position_embeddings", None)
        self.max_model_len = int(max_model_len or ctx or 2048)
        if ctx is not None and self.max_model_len > ctx:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length {ctx}")
        if stop_token_ids is None:
            eos = tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id
            stop_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
            if pad_token_id is None:
                pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        #: about how many (padded) prompt tokens one prefill forward pass takes; see :meth:`_prefill`
        self.prefill_tokens = int(prefill_tokens)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        # transformers 5.24 renamed the forward kwarg ``past_key_values`` to ``cache`` (most models)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        #: kept sequences (token ids -> their keys/values) while :meth:`conversations` is open
        self._kept: dict[tuple[int, ...], _KeptKV] | None = None
        #: prompt tokens prefilled and reused from kept sequences (for benchmarks and tests)
        self.prefix_stats = {"prefilled": 0, "reused": 0}

    @contextlib.contextmanager
    def conversations(self) -> Iterator[None]:
        """Keep each finished sequence's KV cache for the next call's continuations (see the module doc)."""
        outer = self._kept
        self._kept = {} if outer is None else outer
        try:
            yield
        finally:
            self._kept = outer

    # ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.model is None:
            raise RuntimeError("HFEngine is closed")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
        constraints: Sequence[AnswerConstraint | None] | None = None,
    ) -> list[Generation]:
        """See :meth:`RolloutEngine.generate`; ``constraints[i]`` restricts prompt ``i``'s answer span
        (its tokens are sampled among the allowed ids and their log-probs renormalised over them)."""
        self._check_open()
        if not prompts:
            return []
        check_prompts(prompts, self.max_model_len, self.vocab_size)
        if constraints is not None and len(constraints) != len(prompts):
            raise ValueError(f"got {len(constraints)} constraints for {len(prompts)} prompts")
        seed_list = resolve_seeds(len(prompts), params, seeds)
        chunk = self.max_batch_size or len(prompts)
        out: list[Generation] = []
        keeping = self._kept is not None
        # This call's continuations reuse what the previous call kept; it keeps its own for the next.
        previous, kept = self._kept or {}, {}
        hits = [_longest_kept_prefix(previous, p) for p in prompts]
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), chunk):
                end = start + chunk
                out.extend(
                    self._generate_batch(
                        prompts[start:end],
                        params,
                        seed_list[start:end],
                        hits[start:end],
                        kept if keeping else None,
                        None if constraints is None else constraints[start:end],
                    )
                )
        finally:
            self.model.train(was_training)
            if keeping:
                self._kept = kept
        return out

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: list[int],
        hits: Sequence[_KeptKV | None],
        keep: dict[tuple[int, ...], _KeptKV] | None,
        constraints: Sequence[AnswerConstraint | None] | None = None,
    ) -> list[Generation]:
        """Decode ``prompts``; ``hits[i]`` is a kept prefix of prompt ``i`` to start from, and each
        finished sequence's keys/values go into ``keep`` (when given) under its token ids."""
        model = self.model
        device = model.get_input_embeddings().weight.device
        n = len(prompts)
        lens = [len(p) for p in prompts]
        width = max(lens)
        budgets = [min(params.max_new_tokens, self.max_model_len - ln) for ln in lens]
        max_steps = max(budgets)
        stop = set(self.stop_token_ids if params.stop_token_ids is None else params.stop_token_ids)

        uniforms = None
        if not params.greedy:
            uniforms = torch.stack(
                [
                    torch.rand(max_steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                    for s in seeds
                ]
            )

        cache, logits, prompt_mask = self._prefill(prompts, width, max_steps, device, hits)
        width = prompt_mask.shape[1]  # a kept prefix and its continuation may leave a gap of padding
        if keep is not None and not isinstance(cache.layers[0], _buffer_layer_class()):
            keep = None  # a stock cache (sliding-window layers): nothing to keep
        # Attention mask over prompt + generated tokens (left padding, and the gap of a row built on
        # a kept prefix), written in place step by step.
        mask_buf = torch.zeros((n, width + max_steps), dtype=torch.long)
        mask_buf[:, :width] = prompt_mask
        mask_buf = mask_buf.to(device)
        next_pos = torch.tensor(lens, dtype=torch.long, device=device)
        active = torch.arange(n)  # original index of each row still in the batch / cache
        results = [Generation() for _ in range(n)]

        for step in range(max_steps):
            logits = logits.float()
            if torch.isnan(logits).any():
                raise FloatingPointError("the model produced NaN logits during generation")
            allowed = None
            if constraints is not None:
                allowed = [
                    c.allowed() if c is not None else None for c in (constraints[i] for i in active.tolist())
                ]
                logits = restrict_logits(logits, allowed)
            logp = torch.log_softmax(logits, dim=-1)
            if params.greedy:
                tok = logits.argmax(dim=-1)
            else:
                probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
                tok = sample_inverse_cdf(probs, uniforms[active, step]).to(device)
            tok_lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

            live: list[int] = []
            for row, (i, t, lp) in enumerate(
                zip(active.tolist(), tok.tolist(), tok_lp.tolist(), strict=True)
            ):
                g = results[i]
                g.token_ids.append(t)
                g.logprobs.append(lp)
                if allowed is not None:
                    g.allowed.append(allowed[row])
                    c = constraints[i]  # type: ignore[index]
                    if c is not None:
                        c.advance(t)
                if t in stop:
                    g.finish_reason = "stop"
                elif len(g.token_ids) >= budgets[i]:
                    g.finish_reason = "length"
                else:
                    live.append(row)
                    continue
                if keep is not None:  # its cache covers the prompt and every sampled token but this one
                    cols = mask_buf[row, : width + step].nonzero().squeeze(-1)
                    keep[(*prompts[i], *g.token_ids[:-1])] = _KeptKV.of(cache, row, cols)
            if not live:
                break
            if len(live) < len(active):  # drop finished rows so they stop costing compute
                rows = torch.tensor(live, dtype=torch.long)
                rows_dev = rows.to(device)
                cache.batch_select_indices(rows_dev)
                active, tok = active[rows], tok[rows_dev]
                mask_buf, next_pos = mask_buf[rows_dev], next_pos[rows_dev]
            mask_buf[:, width + step] = 1
            logits = model(
                input_ids=tok.unsqueeze(-1),
                attention_mask=mask_buf[:, : width + step + 1],
                position_ids=next_pos.unsqueeze(-1),
                use_cache=True,
                **{self._cache_kw: cache},
            ).logits[:, -1, :]
            next_pos = next_pos + 1
        return results

    def _prefill(  # noqa: C901 - stock-cache, continuation and chunked prefill share one buffer layout
        self,
        prompts: Sequence[Sequence[int]],
        width: int,
        extra: int,
        device: torch.device,
        hits: Sequence[_KeptKV | None],
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Run the prompts through the model; returns the KV cache (room for ``extra`` more tokens),
        each prompt's last-position logits, and the prompts' ``(n, W)`` attention mask.

        Rows without a kept prefix (``hits[i] is None``) are left-padded to ``W``. Identical prompts
        (the members of a group at their first turn) are computed once. The distinct prompts are
        sorted by length and run in chunks of about :attr:`prefill_tokens` tokens, so that rows of a
        chunk have similar lengths (little padding) and a chunk whose rows all have the same length
        needs no attention mask (the fast causal kernel). The chunks' keys and values are written,
        right-aligned, into one preallocated buffer per layer that the decode steps then extend in
        place (no ``torch.cat`` of the whole cache per token). Results equal one padded batch up to
        float rounding.

        Rows with a kept prefix of ``c`` tokens run only their ``s`` new tokens, all in one pass on
        top of the kept keys/values: the kept part is right-aligned in ``P = max c`` columns and the
        new part in the last ``S = max s``, so such a row has a gap of padding between the two
        (masked; its positions continue from ``c``).
        """
        from transformers import DynamicCache

        model = self.model
        n = len(prompts)
        if not _plain_layers(DynamicCache(config=model.config)):
            # e.g. sliding-window layers: one left-padded batch in a stock cache
            ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((n, width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
                mask[i, width - len(p) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp_(min=0)
            cache = DynamicCache(config=model.config)
            logits = self._last_logits(ids, mask, pos, cache, device)
            self.prefix_stats["prefilled"] += sum(len(p) for p in prompts)
            return cache, logits, mask

        hit_rows = [i for i in range(n) if hits[i] is not None]
        miss_rows = [i for i in range(n) if hits[i] is None]
        kept_len = [hits[i].length for i in hit_rows]  # type: ignore[union-attr]
        new_len = [len(prompts[i]) - c for i, c in zip(hit_rows, kept_len, strict=True)]
        span_p, span_s = max(kept_len, default=0), max(new_len, default=0)
        total = max(max((len(prompts[i]) for i in miss_rows), default=0), span_p + span_s)
        prompt_mask = torch.zeros((n, total), dtype=torch.long)
        layers: list[Any] = []
        logits: torch.Tensor | None = None

        def place(out: torch.Tensor, part: Any) -> None:
            nonlocal logits, layers
            if logits is None:
                logits = out.new_empty((n, out.shape[-1]))
                layers = [_buffer_layer(layer.keys, layer.values, n, total + extra) for layer in part.layers]

        if hit_rows:
            out, part = self._prefill_continuations(
                [prompts[i] for i in hit_rows], [hits[i] for i in hit_rows], span_p, span_s, device
            )  # type: ignore[misc]
            place(out, part)
            assert logits is not None
            rows = torch.tensor(hit_rows, device=device)
            logits[rows] = out
            for buf, layer in zip(layers, part.layers, strict=True):
                buf.keys_buf[rows, :, total - span_p - span_s : total] = layer.keys
                buf.values_buf[rows, :, total - span_p - span_s : total] = layer.values
            for i, c, sl in zip(hit_rows, kept_len, new_len, strict=True):
                prompt_mask[i, total - span_s - c : total - span_s] = 1
                prompt_mask[i, total - sl :] = 1
            self.prefix_stats["prefilled"] += sum(new_len)
            self.prefix_stats["reused"] += sum(kept_len)

        index: dict[tuple[int, ...], int] = {}
        src = [index.setdefault(tuple(prompts[i]), len(index)) for i in miss_rows]
        uniq = list(index)
        rows_of: list[list[int]] = [[] for _ in uniq]
        for i, u in zip(miss_rows, src, strict=True):
            rows_of[u].append(i)
            prompt_mask[i, total - len(prompts[i]) :] = 1
        order = sorted(range(len(uniq)), key=lambda u: len(uniq[u]))
        chunks: list[list[int]] = []
        for u in order:  # lengths ascending: the chunk's width is its last (longest) prompt's length
            if chunks and (len(chunks[-1]) + 1) * len(uniq[u]) <= self.prefill_tokens:
                chunks[-1].append(u)
            else:
                chunks.append([u])

        for chunk in chunks:
            cw = len(uniq[chunk[-1]])
            clens = [len(uniq[u]) for u in chunk]
            ids = torch.full((len(chunk), cw), self.pad_token_id, dtype=torch.long)
            for j, u in enumerate(chunk):
                ids[j, cw - clens[j] :] = torch.as_tensor(uniq[u], dtype=torch.long)
            if clens[0] == cw:  # all the same length: no padding, no mask
                mask = None
                pos = torch.arange(cw, dtype=torch.long).expand(len(chunk), cw)
            else:
                mask = (torch.arange(cw)[None, :] >= (cw - torch.tensor(clens))[:, None]).long()
                pos = (mask.cumsum(-1) - 1).clamp_(min=0)
            part = DynamicCache(config=model.config)
            out = self._last_logits(ids, mask, pos, part, device)
            self.prefix_stats["prefilled"] += sum(clens)
            place(out, part)
            assert logits is not None
            for j, u in enumerate(chunk):
                rows = torch.tensor(rows_of[u], device=device)
                logits[rows] = out[j]
                for buf, layer in zip(layers, part.layers, strict=True):
                    buf.keys_buf[rows, :, total - clens[j] : total] = layer.keys[j, :, cw - clens[j] :]
                    buf.values_buf[rows, :, total - clens[j] : total] = layer.values[j, :, cw - clens[j] :]
        for buf in layers:
            buf.set_length(total)
        cache = DynamicCache(config=model.config)
        cache.layers = layers
        assert logits is not None
        return cache, logits, prompt_mask

    def _prefill_continuations(
        self,
        prompts: Sequence[Sequence[int]],
        kept: Sequence[_KeptKV],
        span_p: int,
        span_s: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, Any]:
        """One forward pass over the new tokens of prompts that extend kept sequences.

        Row ``j``'s kept keys/values are right-aligned in the first ``span_p`` columns of the cache
        and its new tokens right-aligned in the next ``span_s``; returns the last-position logits
        and the cache (``span_p + span_s`` columns).
        """
        from transformers import DynamicCache

        h = len(prompts)
        mask = torch.zeros((h, span_p + span_s), dtype=torch.long)
        ids = torch.full((h, span_s), self.pad_token_id, dtype=torch.long)
        pos = torch.zeros((h, span_s), dtype=torch.long)
        layers = [_buffer_layer(k, v, h, span_p + span_s) for k, v in kept[0].layers]
        for j, (prompt, entry) in enumerate(zip(prompts, kept, strict=True)):
            c, s = entry.length, len(prompt) - entry.length
            mask[j, span_p - c : span_p] = 1
            mask[j, span_p + span_s - s :] = 1
            ids[j, span_s - s :] = torch.as_tensor(list(prompt[c:]), dtype=torch.long)
            pos[j, span_s - s :] = torch.arange(c, c + s)
            for buf, (k, v) in zip(layers, entry.layers, strict=True):
                buf.keys_buf[j, :, span_p - c : span_p] = k
                buf.values_buf[j, :, span_p - c : span_p] = v
        for buf in layers:
            buf.set_length(span_p)
        cache = DynamicCache(config=self.model.config)
        cache.layers = layers
        return self._last_logits(ids, mask, pos, cache, device), cache

    def _last_logits(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        pos: torch.Tensor,
        cache: Any,
        device: torch.device,
    ) -> torch.Tensor:
        """One prefill pass of ``ids`` into ``cache``; the logits of each row's last position."""
        return self.model(
            input_ids=ids.to(device),
            attention_mask=None if mask is None else mask.to(device),
            position_ids=pos.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        ).logits[:, -1, :]

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` into the model (dtype/device converted). Tied ``lm_head`` may be omitted."""
        self._check_open()
        missing, unexpected = self.model.load_state_dict(dict(state_dict), strict=False)
        if getattr(self.model.config, "tie_word_embeddings", False):
            missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise KeyError(
                f"update_weights: state dict does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )

    def close(self) -> None:
        self.model = None


_BUFFER_LAYER: type | None = None


def _plain_layers(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a full-attention ``DynamicLayer`` (no sliding window)."""
    from transformers.cache_utils import DynamicLayer

    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class _KeptKV:
    """A finished sequence's keys and values, one ``(heads, length, head_dim)`` pair per layer."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, cache: Any, row: int, cols: torch.Tensor) -> _KeptKV:
        """Copy row ``row``'s columns ``cols`` (its tokens, without padding) out of a buffer cache."""
        return cls(
            int(cols.numel()),
            [(layer.keys_buf[row][:, cols], layer.values_buf[row][:, cols]) for layer in cache.layers],
        )


def _longest_kept_prefix(kept: Mapping[tuple[int, ...], _KeptKV], prompt: Sequence[int]) -> _KeptKV | None:
    """The longest kept sequence that ``prompt`` extends by at least one token, if any."""
    best: tuple[int, ...] | None = None
    n = len(prompt)
    for ids in kept:
        m = len(ids)
        # cheap rejections first: a prompt matches at most its own conversation's sequence
        if (
            0 < m < n
            and (best is None or m > len(best))
            and prompt[m - 1] == ids[-1]
            and prompt[m // 2] == ids[m // 2]
            and tuple(prompt[:m]) == ids
        ):
            best = ids
    return None if best is None else kept[best]


def _buffer_layer(keys: torch.Tensor, values: torch.Tensor, batch: int, capacity: int) -> Any:
    """A zeroed KV-buffer cache layer for ``batch`` rows of ``capacity`` positions, with the heads
    (dim -3), head size (dim -1), dtype and device of the sample ``keys`` / ``values``."""
    shape = (batch, keys.shape[-3], capacity)
    return _buffer_layer_class()(
        keys.new_zeros((*shape, keys.shape[-1])), values.new_zeros((*shape, values.shape[-1]))
    )


def _buffer_layer_class() -> type:
    """The ``DynamicLayer`` subclass over preallocated buffers (defined on first use: transformers
    is imported lazily)."""
    global _BUFFER_LAYER
    if _BUFFER_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class BufferLayer(DynamicLayer):
            """A ``DynamicLayer`` over preallocated ``(batch, heads, capacity, head_dim)`` buffers.

            ``update`` writes the new keys/values in place and exposes the first ``length``
            positions as views, instead of concatenating the whole cache at every token. Unused
            positions are zeros (never NaN: masked positions still meet a 0 attention weight).
            """

            def __init__(self, keys_buf: torch.Tensor, values_buf: torch.Tensor) -> None:
                super().__init__()
                self.keys_buf, self.values_buf = keys_buf, values_buf
                self.device = keys_buf.device
                self.is_initialized = True
                self.set_length(0)

            def set_length(self, length: int) -> None:
                self.length = length
                self.keys = self.keys_buf[:, :, :length]
                self.values = self.values_buf[:, :, :length]

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
                start, end = self.length, self.length + key_states.shape[-2]
                if end > self.keys_buf.shape[-2]:  # out of room (not expected): grow by concatenation
                    pad = (0, 0, 0, end - self.keys_buf.shape[-2])
                    self.keys_buf = torch.nn.functional.pad(self.keys_buf, pad)
                    self.values_buf = torch.nn.functional.pad(self.values_buf, pad)
                self.keys_buf[:, :, start:end] = key_states
                self.values_buf[:, :, start:end] = value_states
                self.set_length(end)
                return self.keys, self.values

            def get_seq_length(self) -> int:
                return self.length

            def batch_select_indices(self, indices: torch.Tensor) -> None:
                self.keys_buf = self.keys_buf[indices]
                self.values_buf = self.values_buf[indices]
                self.set_length(self.length)

            def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
                self.batch_select_indices(beam_idx)

        _BUFFER_LAYER = BufferLayer
    return _BUFFER_LAYER
