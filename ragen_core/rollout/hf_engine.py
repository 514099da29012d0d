"""The ``hf`` rollout engine: a hand-written decode loop over a transformers causal LM with a KV
cache (not ``model.generate``), so that the per-token log-probs and the random stream are under our
control (the log-prob convention of :mod:`ragen_core.rollout.engine`):

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
  preallocated buffer (:mod:`ragen_core.rollout.kv_cache`) that each decode step extends in place,
  instead of HF's ``DynamicCache`` concatenating the whole cache at every token;
* inside :meth:`RolloutEngine.conversations` (the runner opens it around one episode batch), each
  finished sequence's keys and values are kept, and a later prompt that extends a kept sequence
  (the next turn: the same conversation plus the environment's reply) prefills only its new
  tokens on top of them, as vLLM's prefix caching does. Keys are cached after the rotary
  embedding of their own positions, which a continuation shares, so reuse changes nothing but
  float rounding. Outside that scope nothing is kept (the weights may change between calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ragen_core.models.policies import cache_kwarg
from ragen_core.rollout.engine import (
    FinishReason,
    Generation,
    RolloutEngine,
    SamplingParams,
    check_prompts,
    resolve_seeds,
)
from ragen_core.rollout.kv_cache import (
    KeptKV,
    buffer_layer,
    buffer_layer_class,
    longest_kept_prefix,
    plain_layers,
)
from ragen_core.rollout.sampling import filtered_probs, restrict_logits, sample_inverse_cdf

if TYPE_CHECKING:
    from ragen_core.rollout.constrained import AnswerConstraint


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
        self._cache_kw = cache_kwarg(model)
        #: kept sequences (token ids -> their keys/values) while :meth:`conversations` is open
        self._kept: dict[tuple[int, ...], KeptKV] | None = None
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
        previous = self._kept or {}
        kept: dict[tuple[int, ...], KeptKV] = {}
        hits = [longest_kept_prefix(previous, p) for p in prompts]
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
        hits: Sequence[KeptKV | None],
        keep: dict[tuple[int, ...], KeptKV] | None,
        constraints: Sequence[AnswerConstraint | None] | None = None,
    ) -> list[Generation]:
        """Decode ``prompts``; ``hits[i]`` is a kept prefix of prompt ``i`` to start from, and each
        finished sequence's keys/values go into ``keep`` (when given) under its token ids."""
        model = self.model
        device = model.get_input_embeddings().weight.device
        n = len(prompts)
        lens = [len(p) for p in prompts]
        budgets = [min(params.max_new_tokens, self.max_model_len - ln) for ln in lens]
        max_steps = max(budgets)
        stop = set(self.stop_token_ids if params.stop_token_ids is None else params.stop_token_ids)
        uniforms = None if params.greedy else _uniforms(seeds, max_steps)

        cache, logits, prompt_mask = self._prefill(prompts, max(lens), max_steps, device, hits)
        width = prompt_mask.shape[1]  # a kept prefix and its continuation may leave a gap of padding
        if keep is not None and not isinstance(cache.layers[0], buffer_layer_class()):
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
            allowed = _allowed(constraints, active.tolist())
            draws = None if uniforms is None else uniforms[active, step]
            tok, tok_lp = _draw(logits, params, draws, allowed, device)
            live: list[int] = []
            for row, (i, t, lp) in enumerate(
                zip(active.tolist(), tok.tolist(), tok_lp.tolist(), strict=True)
            ):
                g = results[i]
                _append(g, t, lp, allowed, row, None if constraints is None else constraints[i])
                reason = _finish_reason(g, t, stop, budgets[i])
                if reason is None:
                    live.append(row)
                    continue
                g.finish_reason = reason
                if keep is not None:  # its cache covers the prompt and every sampled token but this one
                    cols = mask_buf[row, : width + step].nonzero().squeeze(-1)
                    keep[(*prompts[i], *g.token_ids[:-1])] = KeptKV.of(cache, row, cols)
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

    def _prefill(
        self,
        prompts: Sequence[Sequence[int]],
        width: int,
        extra: int,
        device: torch.device,
        hits: Sequence[KeptKV | None],
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

        if not plain_layers(DynamicCache(config=self.model.config)):
            return self._prefill_stock(prompts, width, device)
        n = len(prompts)
        hit_rows = [i for i in range(n) if hits[i] is not None]
        miss_rows = [i for i in range(n) if hits[i] is None]
        kept = [k for k in hits if k is not None]
        new_len = [len(prompts[i]) - k.length for i, k in zip(hit_rows, kept, strict=True)]
        span_p, span_s = max((k.length for k in kept), default=0), max(new_len, default=0)
        total = max(max((len(prompts[i]) for i in miss_rows), default=0), span_p + span_s)
        target = _PrefillTarget(n, total, total + extra)
        prompt_mask = torch.zeros((n, total), dtype=torch.long)
        if hit_rows:
            self._prefill_kept(prompts, hit_rows, kept, (span_p, span_s), target, prompt_mask, device)
        # Identical prompts (a group's members at their first turn) are run once, for all their rows.
        rows_of: dict[tuple[int, ...], list[int]] = {}
        for i in miss_rows:
            rows_of.setdefault(tuple(prompts[i]), []).append(i)
            prompt_mask[i, total - len(prompts[i]) :] = 1
        uniq = list(rows_of)
        for chunk in _length_chunks([len(p) for p in uniq], self.prefill_tokens):
            self._prefill_chunk([uniq[u] for u in chunk], [rows_of[uniq[u]] for u in chunk], target, device)
        return target.cache(self.model.config), target.filled_logits(), prompt_mask

    def _prefill_kept(
        self,
        prompts: Sequence[Sequence[int]],
        hit_rows: Sequence[int],
        kept: Sequence[KeptKV],
        spans: tuple[int, int],
        target: _PrefillTarget,
        prompt_mask: torch.Tensor,
        device: torch.device,
    ) -> None:
        """Prefill the rows ``hit_rows`` on top of their ``kept`` prefixes (``spans``: the widest
        kept part and the widest new part) into ``target``, and mark their tokens in ``prompt_mask``."""
        span_p, span_s = spans
        total = target.total
        out, part = self._prefill_continuations([prompts[i] for i in hit_rows], kept, span_p, span_s, device)
        target.allocate(out, part)
        target.write(torch.tensor(hit_rows, device=device), out, [(la.keys, la.values) for la in part.layers])
        for i, entry in zip(hit_rows, kept, strict=True):
            new = len(prompts[i]) - entry.length
            prompt_mask[i, total - span_s - entry.length : total - span_s] = 1
            prompt_mask[i, total - new :] = 1
        self.prefix_stats["prefilled"] += sum(
            len(prompts[i]) - k.length for i, k in zip(hit_rows, kept, strict=True)
        )
        self.prefix_stats["reused"] += sum(k.length for k in kept)

    def _prefill_stock(
        self, prompts: Sequence[Sequence[int]], width: int, device: torch.device
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The prefill for a model whose cache layers are not plain (e.g. sliding-window layers): one
        left-padded batch in a stock ``DynamicCache``."""
        from transformers import DynamicCache

        n = len(prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._last_logits(ids, mask, pos, cache, device)
        self.prefix_stats["prefilled"] += sum(len(p) for p in prompts)
        return cache, logits, mask

    def _prefill_chunk(
        self,
        prompts: Sequence[tuple[int, ...]],
        rows_of: Sequence[list[int]],
        target: _PrefillTarget,
        device: torch.device,
    ) -> None:
        """One forward pass over distinct ``prompts`` sorted by length (the last is the longest);
        prompt ``j``'s logits and keys/values go to the batch rows ``rows_of[j]``."""
        from transformers import DynamicCache

        cw = len(prompts[-1])
        clens = [len(p) for p in prompts]
        ids = torch.full((len(prompts), cw), self.pad_token_id, dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, cw - clens[j] :] = torch.as_tensor(p, dtype=torch.long)
        mask: torch.Tensor | None
        if clens[0] == cw:  # all the same length: no padding, no mask
            mask = None
            pos = torch.arange(cw, dtype=torch.long).expand(len(prompts), cw)
        else:
            mask = (torch.arange(cw)[None, :] >= (cw - torch.tensor(clens))[:, None]).long()
            pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        part: Any = DynamicCache(config=self.model.config)  # its layers: plain DynamicLayers here
        out = self._last_logits(ids, mask, pos, part, device)
        self.prefix_stats["prefilled"] += sum(clens)
        target.allocate(out, part)
        for j, rows in enumerate(rows_of):
            kv = [(la.keys[j, :, cw - clens[j] :], la.values[j, :, cw - clens[j] :]) for la in part.layers]
            target.write(torch.tensor(rows, device=device), out[j], kv)

    def _prefill_continuations(
        self,
        prompts: Sequence[Sequence[int]],
        kept: Sequence[KeptKV],
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
        layers = [buffer_layer(k, v, h, span_p + span_s) for k, v in kept[0].layers]
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
        logits: torch.Tensor = self.model(
            input_ids=ids.to(device),
            attention_mask=None if mask is None else mask.to(device),
            position_ids=pos.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        ).logits[:, -1, :]
        return logits

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


def _uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """``(n, steps)`` uniforms, row ``i`` the first ``steps`` draws of ``torch.Generator(seeds[i])``:
    each sequence's random stream, independent of the batch it is decoded in."""
    return torch.stack(
        [torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    )


def _allowed(
    constraints: Sequence[AnswerConstraint | None] | None, rows: Sequence[int]
) -> list[tuple[int, ...] | None] | None:
    """The ids each of ``rows`` may sample now (``None``: free), or ``None`` for an unconstrained call."""
    if constraints is None:
        return None
    return [None if (c := constraints[i]) is None else c.allowed() for i in rows]


def _draw(
    logits: torch.Tensor,
    params: SamplingParams,
    uniforms: torch.Tensor | None,
    allowed: Sequence[Sequence[int] | None] | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from the next-token ``logits`` (argmax when greedy, else the inverse-CDF draw
    of ``uniforms``), and its log-prob at temperature 1 (over the allowed ids when constrained)."""
    logits = logits.float()
    if torch.isnan(logits).any():
        raise FloatingPointError("the model produced NaN logits during generation")
    if allowed is not None:
        logits = restrict_logits(logits, allowed)
    logp = torch.log_softmax(logits, dim=-1)
    if uniforms is None:
        tok = logits.argmax(dim=-1)
    else:
        probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
        tok = sample_inverse_cdf(probs, uniforms).to(device)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def _append(
    g: Generation,
    token: int,
    logprob: float,
    allowed: Sequence[tuple[int, ...] | None] | None,
    row: int,
    constraint: AnswerConstraint | None,
) -> None:
    """Add a sampled token to ``g`` (with the ids it was sampled among, under constraints) and move
    its answer constraint past it."""
    g.token_ids.append(token)
    g.logprobs.append(logprob)
    if allowed is not None:
        g.allowed.append(allowed[row])
        if constraint is not None:
            constraint.advance(token)


def _finish_reason(g: Generation, token: int, stop: set[int], budget: int) -> FinishReason | None:
    """Why ``g`` ends at its last ``token`` (a stop token, or its budget of new tokens), or ``None``."""
    if token in stop:
        return "stop"
    if len(g.token_ids) >= budget:
        return "length"
    return None


def _length_chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` sorted ascending and cut into chunks of at most ``budget`` padded tokens
    (a chunk's width is its last, longest member; a longer one gets a chunk of its own)."""
    chunks: list[list[int]] = []
    for u in sorted(range(len(lengths)), key=lambda u: lengths[u]):
        if chunks and (len(chunks[-1]) + 1) * lengths[u] <= budget:
            chunks[-1].append(u)
        else:
            chunks.append([u])
    return chunks


class _PrefillTarget:
    """Where a prefill's passes land: each batch row's last-position logits and one KV buffer per layer
    of ``capacity`` positions, the prompts right-aligned in the first ``total``. Allocated by the first
    pass, whose outputs give the vocabulary, heads, head size, dtype and device."""

    def __init__(self, rows: int, total: int, capacity: int) -> None:
        self.rows, self.total, self.capacity = rows, total, capacity
        self.logits: torch.Tensor | None = None
        self.layers: list[Any] = []

    def allocate(self, logits: torch.Tensor, part: Any) -> None:
        if self.logits is None:
            self.logits = logits.new_empty((self.rows, logits.shape[-1]))
            self.layers = [buffer_layer(la.keys, la.values, self.rows, self.capacity) for la in part.layers]

    def write(
        self, rows: torch.Tensor, logits: torch.Tensor, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Put ``logits`` and one pass's keys/values (per layer, right-aligned at ``total``) in ``rows``."""
        assert self.logits is not None, "allocate() before write()"
        self.logits[rows] = logits
        for buf, (keys, values) in zip(self.layers, kv, strict=True):
            buf.keys_buf[rows, :, self.total - keys.shape[-2] : self.total] = keys
            buf.values_buf[rows, :, self.total - values.shape[-2] : self.total] = values

    def filled_logits(self) -> torch.Tensor:
        assert self.logits is not None, "a prefill of no prompts"
        return self.logits

    def cache(self, config: Any) -> Any:
        """The buffers as a ``DynamicCache`` holding the ``total`` prompt positions."""
        from transformers import DynamicCache

        for buf in self.layers:
            buf.set_length(self.total)
        cache = DynamicCache(config=config)
        cache.layers = self.layers
        return cache
