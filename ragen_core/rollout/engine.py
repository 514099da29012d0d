"""Rollout engines' contract: batched sampling over token-id prompts (token-in, token-out).

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

The backends: :class:`~ragen_core.rollout.hf_engine.HFEngine` (the CPU default, our own KV-cached
decode loop) and :class:`~ragen_core.rollout.vllm_engine.VLLMEngine` (vLLM in its own interpreter).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

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
