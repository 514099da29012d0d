"""The learner: one PPO / GRPO / StarPO update of a policy (and its critic) on a batch of trajectories.

``Learner.step(batch)`` reads top to bottom like veRL's / CleanRL's update (docs/architecture.md,
"Learner step"):

1. check the batch (nothing is modified when it is bad);
2. old log-probs of the sampled tokens under the current policy (no grad, temperature 1), the
   reference policy's log-probs (only when a KL term is on) and the critic's values (only for GAE);
3. token rewards: the trajectory score (after RAGEN-2's reward normalisation, when configured) on its
   last trained token (docs/architecture.md, "Trajectory schema"), or with ``use_turn_scores`` each
   trained turn's score on its last token, minus ``kl_coef`` x KL(old || ref) on every trained token
   when ``use_kl_in_reward``;
4. advantages with ``ragen_core.algorithms`` (GAE + whitening, bi-level GAE, GRPO, RLOO,
   REINFORCE++), then RAGEN-2's advantage options (soft reweighting, length weighting, zeroing),
   times ``advantage_scale`` (``rollout.filter.loss_scaling``);
5. the critic update (first, as veRL), then the actor update: ``ppo_epochs`` x mini-batches, each
   mini-batch split into micro-batches whose gradients are accumulated with the mini-batch's
   *global* token counts (so the result does not depend on ``micro_batch_size`` nor, in a
   data-parallel group, on the number of learners), gradient clipping (the pre-clip norm is
   reported), and a skipped optimiser step when the gradient norm is not finite;
6. metrics with RAGEN / veRL names (docs/metrics.md).

Token alignment (docs/architecture.md, "Trajectory schema"): ``loss_mask[b, t] = 1`` says token t
was sampled by the policy. Its log-prob and its value come from the model's output at position t - 1
(the state before the token was chosen); every per-token tensor here is indexed by the *target*
position t, and position 0 (nothing before it) is never trained.

Data parallelism: when ``torch.distributed`` is initialised with more than one process, every
learner receives the whole batch, computes old log-probs / values for its contiguous share of the
rows (then all-reduced), computes the same advantages, and trains on its contiguous share of each
mini-batch; gradients are summed with an all-reduce, so every rank takes the same optimiser step.
Parameters are broadcast from rank 0 at construction. See ``ragen_core.learner.actors``.

The learner's config is ``ragen_core.config.learner``, its critic ``ragen_core.learner.critic``, and the
checkpoint files it saves and loads ``ragen_core.learner.checkpoint``; this module holds the update itself.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ragen_core.algorithms import (
    agg_loss,
    bilevel_gae,
    gae,
    grpo,
    kl_penalty,
    length_weight,
    masked_mean,
    normalize_scores,
    policy_loss,
    reinforce_pp,
    restrict_to_allowed,
    rloo,
    soft_advantage_weights,
    turn_rewards_to_tokens,
    value_loss,
    whiten,
)
from ragen_core.config.learner import LearnerConfig
from ragen_core.learner.batch import BadBatchError, TokenBatch, check_batch
from ragen_core.learner.checkpoint import load_into, read_checkpoint, set_rng_state, write_checkpoint
from ragen_core.learner.critic import ValueModel, backbone, build_critic

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["BadBatchError", "Learner", "seed_everything"]


# --------------------------------------------------------------------------------------------------
# Token alignment
# --------------------------------------------------------------------------------------------------


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


def _to_targets(per_position: torch.Tensor) -> torch.Tensor:
    """Shift outputs at positions 0..L-2 to target positions 1..L-1; target 0 gets 0."""
    return _prepend_zero(per_position[:, :-1])


def _prepend_zero(x: torch.Tensor) -> torch.Tensor:
    """(b, L-1) values of targets 1..L-1 -> (b, L) indexed by target position, target 0 = 0."""
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)


# --------------------------------------------------------------------------------------------------
# Learner
# --------------------------------------------------------------------------------------------------


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous near-equal ranges covering range(n)."""
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


class _UpdateMetrics:
    """The metrics of a step's optimiser updates, summed over micro-batches, reduced across ranks once.

    Two kinds of metric, kept apart because the step averages them differently (``Learner._metrics``):

    - ``per_update``: one value per optimiser update (a loss: each micro-batch adds its share of its
      mini-batch's loss; a gradient norm), reported as the mean over the step's updates;
    - ``per_token``: a mean over a micro-batch's trained tokens (entropy, clip fractions, approx KL,
      predicted values), added times those tokens and reported as the mean over all trained tokens.

    ``counts`` holds, per role (``actor/``, ``critic/``), the denominators ``updates`` and ``tokens``,
    and ``skipped_steps``, reported as a count. Keys are the logged metric names.
    """

    def __init__(self) -> None:
        self.per_update: dict[str, float] = {}
        self.per_token: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    @staticmethod
    def _add(sums: dict[str, float], key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    def declare(self, per_update: list[str], per_token: list[str], counts: list[str]) -> None:
        """Add 0 to every key an update reports: the same keys on every rank (an all-reduce needs
        equal lengths), even on a rank without rows in this mini-batch."""
        for sums, keys in ((self.per_update, per_update), (self.per_token, per_token), (self.counts, counts)):
            for key in keys:
                self._add(sums, key, 0.0)

    def add(self, key: str, value: float | torch.Tensor) -> None:
        """A per-update value: a micro-batch's share of the update's loss, or the update's grad norm."""
        self._add(self.per_update, key, float(value))

    def add_token_mean(self, key: str, mean: float | torch.Tensor, n_tokens: float) -> None:
        """A mean over ``n_tokens`` trained tokens, weighted by them."""
        self._add(self.per_token, key, float(mean * n_tokens))

    def count(self, key: str, n: float | torch.Tensor) -> None:
        self._add(self.counts, key, float(n))

    def reduce(self, world_size: int, device: torch.device) -> None:
        """Sum every metric over the data-parallel group, in place, with one all-reduce."""
        if world_size == 1:
            return
        slots = [
            (sums, key) for sums in (self.per_update, self.per_token, self.counts) for key in sorted(sums)
        ]
        if not slots:
            return
        buf = torch.tensor([sums[key] for sums, key in slots], dtype=torch.float64, device=device)
        dist.all_reduce(buf)
        for (sums, key), total in zip(slots, buf.tolist(), strict=True):
            sums[key] = total


@dataclass
class _StepTensors:
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


class Learner:
    """Holds the policy, the critic (GAE only), the reference policy (KL only) and their optimisers.

    Args:
        policy: a Hugging Face causal LM (``Qwen2ForCausalLM`` and the like). With ``cfg.lora.rank``
            > 0 it is wrapped with a peft LoRA adapter here.
        cfg: the learner config.
        critic_model: a ready ``ValueModel``; by default one is built from ``cfg.optim.critic``.
        ref_model: the frozen reference policy; by default a frozen copy of ``policy`` (or, with
            LoRA, the policy with its adapter disabled). Built only when a KL term is on.
        device: by default ``cuda`` when ``cfg.num_gpus > 0`` and CUDA is available, else CPU.
    """

    def __init__(
        self,
        policy: nn.Module,
        cfg: LearnerConfig | None = None,
        critic_model: ValueModel | None = None,
        ref_model: nn.Module | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.cfg = cfg = cfg or LearnerConfig()
        if device is None:
            device = "cuda" if cfg.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        alg, opt = cfg.algorithm, cfg.optim

        policy = policy.to(self.device)
        # The critic is built before LoRA wraps the policy, so a separate critic copies plain weights.
        self.critic: ValueModel | None = None
        if alg.use_critic:
            self.critic = critic_model if critic_model is not None else build_critic(policy, opt, cfg.seed)
            self.critic.to(self.device).eval()
        self.lora = cfg.lora.rank > 0
        if self.lora:
            policy = self._apply_lora(policy)
        self.policy = policy.eval()  # eval: no dropout, so old and new log-probs agree at ratio 1
        self.ref: nn.Module | None = None
        if alg.use_ref and not self.lora:
            self.ref = ref_model if ref_model is not None else copy.deepcopy(policy)
            self.ref.to(self.device).eval().requires_grad_(False)

        self.actor_params = [p for p in self.policy.parameters() if p.requires_grad]
        self.actor_optim = torch.optim.AdamW(
            self.actor_params, lr=opt.actor_lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_optim, lambda _: 1.0)
        self.critic_params: list[nn.Parameter] = []
        self.critic_optim: torch.optim.Optimizer | None = None
        self.critic_sched: torch.optim.lr_scheduler.LRScheduler | None = None
        if self.critic is not None:
            self.critic_params = [p for p in self.critic.parameters() if p.requires_grad]
            self.critic_optim = torch.optim.AdamW(
                self.critic_params,
                lr=opt.critic_lr,
                betas=opt.betas,
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_optim, lambda _: 1.0)
        self.global_step = 0
        self.skipped_steps = 0
        if self.world_size > 1:
            self._broadcast_parameters()

    # ---------------------------------------------------------------- construction helpers

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        cfg: LearnerConfig | None = None,
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> Learner:
        """Load the policy (and, with ``optim.critic_model_path``, the critic backbone) from disk."""
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return cls(policy, cfg, **kwargs)

    def _apply_lora(self, policy: nn.Module) -> nn.Module:
        try:
            import peft
        except ImportError as exc:  # pragma: no cover - peft is an optional extra
            raise ImportError("lora.rank > 0 needs peft: pip install 'ragen-flow[lora]'") from exc
        lc = self.cfg.lora
        config = peft.LoraConfig(
            r=lc.rank,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=lc.target_modules,
            task_type="CAUSAL_LM",
            bias="none",
        )
        return peft.get_peft_model(policy, config)

    def _broadcast_parameters(self) -> None:
        for module in (self.policy, self.critic, self.ref):
            if module is None:
                continue
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)

    # ---------------------------------------------------------------- forward passes

    def _autocast(self) -> torch.autocast | nullcontext[None]:
        if self.device.type == "cuda" and self.cfg.bf16_autocast_on_gpu:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if self.device.type == "cpu" and self.cfg.bf16_autocast_on_cpu:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return nullcontext()

    @contextmanager
    def _ref_policy(self) -> Iterator[nn.Module]:
        if self.lora:
            with cast("PeftModel", self.policy).disable_adapter():
                yield self.policy
        else:
            assert self.ref is not None
            yield self.ref

    def _logprobs(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-prob (and entropy) of each trained target token t from the output at t - 1, shape (b, l).

        ``allowed`` (b, l, K): for tokens sampled under constrained decoding, the ids they were sampled
        among (-1-padded; all -1 elsewhere). Their distribution is the softmax over those ids alone,
        ``log pi_c(y) = z_y - logsumexp_{a in A} z_a``, and so is their entropy: the policy that played.

        Zero outside ``mask``. For the decoder families of ``_HEAD_ONLY_ON_MASK`` the LM head and
        the softmax run only on the trained positions (environment and prompt tokens need no
        vocabulary distribution); other models compute full logits. The entropy comes from the same
        log-softmax, H = -sum_v p_v log p_v (equal to ``algorithms.entropy_from_logits``, sharing the
        log-softmax's backward).
        """
        targets = mask[:, 1:]
        with self._autocast():
            if _model_type(model) in _HEAD_ONLY_ON_MASK:
                hidden = backbone(model)(input_ids=input_ids, use_cache=False).last_hidden_state
                logits = cast("PreTrainedModel", model).get_output_embeddings()(hidden[:, :-1][targets])
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

    def _values(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.critic is not None
        with self._autocast():
            values = self.critic(input_ids)
        return _to_targets(values.float() if values.dtype in (torch.bfloat16, torch.float16) else values)

    @torch.no_grad()
    def _infer(
        self,
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        lengths: torch.Tensor,
        dtype: torch.dtype,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``fn(ids, mask, allowed) -> (b, l)`` over this rank's share of the rows in micro-batches
        (``allowed``: the rows' slice of it, or None); all-reduce."""
        batch, length = input_ids.shape
        out = torch.zeros(batch, length, dtype=dtype, device=self.device)
        lo, hi = _split(batch, self.world_size)[self.rank]
        mbs = self.cfg.optim.micro_batch_size
        for start in range(lo, hi, mbs):
            end = min(start + mbs, hi)
            width = int(lengths[start:end].max())
            part = None if allowed is None else allowed[start:end, :width]
            out[start:end, :width] = fn(input_ids[start:end, :width], mask[start:end, :width], part).to(dtype)
        if self.world_size > 1:
            dist.all_reduce(out)
        return out

    @torch.no_grad()
    def cross_logprobs(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Summed log-prob of every response after every prompt under the current policy, ``(R, P)``
        float64 on the CPU: entry [i, j] = Σ_t log π(z_i,t | x_j, z_i,<t) (teacher forcing, temperature
        1). The collapse metrics' input (``ragen_core.run.collapse_probe``); no gradient, no RNG."""
        n_r, n_p = len(responses), len(prompts)
        if n_r == 0 or n_p == 0:
            return torch.zeros(n_r, n_p, dtype=torch.float64)
        seqs = [(list(x) + list(z), len(x)) for z in responses for x in prompts]  # row i * P + j
        lengths = torch.tensor([len(s) for s, _ in seqs], dtype=torch.int64)
        width = int(lengths.max())
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.bool)
        for r, (s, start) in enumerate(seqs):
            input_ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[r, start : len(s)] = True
        fdtype = torch.promote_types(next(self.policy.parameters()).dtype, torch.float32)
        logp = self._infer(
            lambda ids, m, a: self._logprobs(self.policy, ids, m)[0],
            input_ids.to(self.device),
            mask.to(self.device),
            lengths.to(self.device),
            fdtype,
        )
        return logp.double().sum(dim=1).reshape(n_r, n_p).cpu()

    # ---------------------------------------------------------------- checks

    def _vocab_size(self) -> int | None:
        emb = (
            cast("PreTrainedModel", self.policy).get_input_embeddings()
            if hasattr(self.policy, "get_input_embeddings")
            else None
        )
        return int(cast(torch.Tensor, emb.weight).shape[0]) if emb is not None else None

    # ---------------------------------------------------------------- rewards and advantages

    @staticmethod
    def _dense_turns(turn_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Renumber each row's trained turns 0, 1, 2, ... in order (padding / env tokens get 0)."""
        masked = torch.where(mask, turn_index, torch.full_like(turn_index, -(2**62)))
        prev = torch.cummax(masked, dim=1).values
        prev = torch.cat([torch.full_like(prev[:, :1], -(2**62)), prev[:, :-1]], dim=1)
        new_turn = mask & (turn_index != prev)
        dense = torch.cumsum(new_turn.long(), dim=1) - 1
        return torch.where(mask, dense, torch.zeros_like(dense))

    def _turn_rewards(
        self, batch: TokenBatch, turn_scores: torch.Tensor | None, mask: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(turns, turn_rewards)``: each row's trained turns numbered 0, 1, ... (``_dense_turns``) and
        the reward of each, (B, K): the batch's turn scores, or without them the trajectory score on
        its last trained turn."""
        turns = self._dense_turns(batch.turn_index[:, : mask.shape[1]].to(self.device), mask)
        n_turns = int(turns.max()) + 1
        if turn_scores is None:  # the trajectory score on its last trained turn
            turn_rewards = torch.zeros(mask.shape[0], n_turns, dtype=dtype, device=self.device)
            last_turn = torch.where(mask, turns, torch.zeros_like(turns)).max(dim=1).values
            turn_rewards[torch.arange(mask.shape[0], device=self.device), last_turn] = batch.scores.to(
                self.device, dtype
            )
        else:
            turn_rewards = torch.zeros(
                mask.shape[0], max(n_turns, turn_scores.shape[1]), dtype=dtype, device=self.device
            )
            turn_rewards[:, : turn_scores.shape[1]] = turn_scores.to(self.device, dtype)
        return turns, turn_rewards

    def _score_groups(self, batch: TokenBatch) -> torch.Tensor | tuple[str, ...] | list[int]:
        """The group key of each row for reward normalisation (``reward_normalization.grouping``)."""
        grouping = self.cfg.algorithm.reward_normalization.grouping
        if grouping == "state":
            return batch.group_ids
        if grouping == "inductive":
            return cast("tuple[str, ...]", batch.env_tags)  # checked by check_batch
        return [0] * len(batch.scores)

    def _advantage_options(
        self, advantages: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor, batch: TokenBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """RAGEN-2's options applied to the estimator's advantages, in its order: soft reweighting by
        the group's score std, division by the relative length (both GRPO only), zeroing."""
        alg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        if alg.soft_advantage_reweight:
            group_ids = batch.group_ids.to(self.device)
            weight = soft_advantage_weights(token_rewards.sum(dim=1), group_ids)  # GRPO's own scores
            advantages = advantages * weight[:, None]
            first: dict[int, int] = {}  # one weight per group, as RAGEN-2 reports them
            for row, g in enumerate(group_ids.tolist()):
                first.setdefault(g, row)
            per_group = weight[list(first.values())]
            metrics["train/soft_reweight_min"] = float(per_group.min())
            metrics["train/soft_reweight_max"] = float(per_group.max())
            metrics["train/soft_reweight_mean"] = float(per_group.mean())
        if alg.grpo_advantage_length_weight:
            advantages = length_weight(advantages, mask)
        if alg.zero_task_advantage:
            advantages = torch.zeros_like(advantages)
        return advantages, metrics

    def _advantages(
        self,
        token_rewards: torch.Tensor,
        kl: torch.Tensor | None,
        values: torch.Tensor | None,
        mask: torch.Tensor,
        batch: TokenBatch,
        turn_scores: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        alg = self.cfg.algorithm
        maskf = mask.to(token_rewards.dtype)
        if alg.adv_estimator == "gae":
            assert values is not None
            if alg.bi_level_gae:
                turns, turn_rewards = self._turn_rewards(batch, turn_scores, mask, token_rewards.dtype)
                if kl is not None:  # the in-reward KL of a turn's tokens is charged to that turn
                    turn_rewards = turn_rewards.scatter_add(1, turns, -alg.kl_coef * kl * maskf)
                adv, ret = bilevel_gae(
                    turn_rewards, values, mask, turns, alg.gamma, alg.lam, alg.high_level_gamma
                )
            else:
                adv, ret = gae(token_rewards, values, mask, alg.gamma, alg.lam)
            if alg.whiten_advantages:
                adv = whiten(adv, mask)
            return adv, ret
        if alg.adv_estimator == "reinforce_pp":
            return reinforce_pp(token_rewards, mask, alg.gamma)
        seq_scores = token_rewards.sum(dim=1)  # score (- its KL penalty when use_kl_in_reward)
        group_ids = batch.group_ids.to(self.device)
        if alg.adv_estimator == "grpo":
            per_seq = grpo(seq_scores, group_ids, alg.norm_adv_by_std)
        else:
            per_seq = rloo(seq_scores, group_ids)
        adv = per_seq[:, None] * maskf
        return adv, adv

    # ---------------------------------------------------------------- the step

    def step(  # noqa: C901 - the numbered steps of the update, read top to bottom like the paper
        self,
        batch: TokenBatch,
        turn_scores: torch.Tensor | None = None,
        advantage_scale: float = 1.0,
        behaviour_logprobs: bool = False,
    ) -> dict[str, float]:
        """One learner iteration on ``batch``; returns its metrics under their logged names (floats).

        ``turn_scores`` (B, K): reward of each trajectory's k-th trained turn, for bi-level GAE
        (default: the score on the last turn). Read from ``batch.turn_scores`` when not given.
        ``advantage_scale``: the advantages are multiplied by it after the estimator (RAGEN-2's
        ``filter_loss_scaling``, ``rollout.filter.loss_scaling``); the returns are not.
        ``behaviour_logprobs``: the old log-probs of the PPO ratio are the batch's own
        ``rollout_logprobs`` (those of the policy that played it, ``trainer.off_policy_steps``), not
        recomputed with the current weights: the ratio then corrects for the policy having moved since.
        """
        t_start = time.perf_counter()
        if turn_scores is None:
            turn_scores = getattr(batch, "turn_scores", None)
        check_batch(batch, turn_scores, self.cfg, self._vocab_size())
        alg, opt = self.cfg.algorithm, self.cfg.optim
        dev = self.device
        timing: dict[str, float] = {}

        lengths = batch.attention_mask.sum(dim=1).to(dev)
        width = int(lengths.max())
        input_ids = batch.input_ids[:, :width].to(dev, torch.long)
        mask = (batch.loss_mask[:, :width] != 0).to(dev)
        param_dtype = next(self.policy.parameters()).dtype
        fdtype = torch.promote_types(param_dtype, torch.float32)
        maskf = mask.to(fdtype)
        scores = batch.scores.to(dev, fdtype)
        n_seq = mask.shape[0]
        allowed = getattr(batch, "allowed_token_ids", None)
        if allowed is not None:
            allowed = allowed[:, :width].to(dev)

        # 1. old log-probs, reference log-probs, values (no grad) --------------------------------
        n_mini = max(1, n_seq // opt.mini_batch_size)
        # One update on the whole batch from the current weights: its own forward pass gives the old
        # log-probs (filled in by _update before the loss reads them).
        from_update = (
            opt.old_logprobs_from_update
            and not behaviour_logprobs
            and opt.ppo_epochs == 1
            and n_mini == 1
            and self.world_size == 1
            and not alg.use_kl_in_reward
        )
        t = time.perf_counter()
        if behaviour_logprobs:
            old_logp = batch.rollout_logprobs[:, :width].to(dev, fdtype) * maskf
            if not bool((old_logp[mask] != 0).any()):
                raise ValueError(
                    "trainer.off_policy_steps needs the rollouts' log-probs, and this batch has none (all 0): "
                    "use a rollout engine that returns them (hf and vllm both do), or trainer.off_policy_steps=0"
                )
        elif from_update:
            old_logp = torch.zeros_like(maskf)
        else:
            old_logp = self._infer(
                lambda ids, m, a: self._logprobs(self.policy, ids, m, allowed=a)[0],
                input_ids,
                mask,
                lengths,
                fdtype,
                allowed,
            )
            timing["old_log_prob"] = time.perf_counter() - t
        ref_logp = None
        if alg.use_ref:
            t = time.perf_counter()
            with self._ref_policy() as ref:
                ref_logp = self._infer(
                    lambda ids, m, a: self._logprobs(ref, ids, m, allowed=a)[0],
                    input_ids,
                    mask,
                    lengths,
                    fdtype,
                    allowed,
                )
            timing["ref"] = time.perf_counter() - t
        values = None
        if self.critic is not None:
            t = time.perf_counter()
            values = (
                self._infer(lambda ids, m, a: self._values(ids), input_ids, mask, lengths, fdtype) * maskf
            )
            timing["values"] = time.perf_counter() - t

        # 2. token rewards: the (normalised) score on the last trained token, or each trained turn's
        #    score on its last token (use_turn_scores); - KL penalty ----------------------------------
        t = time.perf_counter()
        norm = alg.reward_normalization
        if alg.use_turn_scores:
            turns, turn_rewards = self._turn_rewards(batch, turn_scores, mask, fdtype)
            token_rewards = turn_rewards_to_tokens(turn_rewards, mask, turns)
        else:
            rewarded = (
                normalize_scores(scores, self._score_groups(batch), norm.method) if norm.active else scores
            )
            positions = torch.arange(mask.shape[1], device=dev)
            last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
            token_rewards = torch.zeros_like(maskf)
            token_rewards[torch.arange(n_seq, device=dev), last] = rewarded
        kl_in_reward = None
        if alg.use_kl_in_reward:
            assert ref_logp is not None
            kl_in_reward = kl_penalty(old_logp, ref_logp, alg.kl_in_reward_type) * maskf
            token_rewards = token_rewards - alg.kl_coef * kl_in_reward

        # 3. advantages, then RAGEN-2's options on them ----------------------------------------------
        advantages, returns = self._advantages(token_rewards, kl_in_reward, values, mask, batch, turn_scores)
        advantages, option_metrics = self._advantage_options(advantages, token_rewards, mask, batch)
        if advantage_scale != 1.0:
            advantages = advantages * advantage_scale
        timing["adv"] = time.perf_counter() - t

        # 4. mini-batches: floor(B / mini) contiguous near-equal slices per epoch -----------------
        epochs_rows = []
        for epoch in range(opt.ppo_epochs):
            if opt.shuffle:
                gen = torch.Generator().manual_seed(
                    self.cfg.seed * 1_000_003 + self.global_step * 1009 + epoch
                )
                order = torch.randperm(n_seq, generator=gen).to(dev)
            else:
                order = torch.arange(n_seq, device=dev)
            epochs_rows.append([order[a:b] for a, b in _split(n_seq, n_mini)])
        data = _StepTensors(
            input_ids=input_ids,
            mask=mask,
            lengths=lengths,
            old_logp=old_logp,
            ref_logp=ref_logp,
            values=values,
            returns=returns,
            advantages=advantages,
            old_logp_from_update=from_update,
            allowed=allowed,
        )
        acc = _UpdateMetrics()

        # 5a. critic update (first, as veRL) --------------------------------------------------------
        if self.critic is not None:
            t = time.perf_counter()
            for minibatches in epochs_rows:
                for rows in minibatches:
                    self._update(rows, data, acc, critic=True)
            timing["update_critic"] = time.perf_counter() - t

        # 5b. actor update ---------------------------------------------------------------------------
        t = time.perf_counter()
        for minibatches in epochs_rows:
            for rows in minibatches:
                self._update(rows, data, acc, critic=False)
        timing["update_actor"] = time.perf_counter() - t
        # constant LR; stepped once per learner step (after an optimiser step, as torch expects)
        if self.actor_optim.state:
            self.actor_sched.step()
        if self.critic_sched is not None and self.critic_optim is not None and self.critic_optim.state:
            self.critic_sched.step()
        self.global_step += 1

        # 6. metrics ---------------------------------------------------------------------------------
        acc.reduce(self.world_size, dev)
        metrics = self._metrics(acc, data, scores, token_rewards, maskf, batch, ref_logp)
        metrics.update(option_metrics)
        step_s = time.perf_counter() - t_start
        for k, v in timing.items():
            metrics[f"timing_s/{k}"] = v
        metrics["timing_s/step"] = step_s
        total_tokens = float(lengths.sum())
        metrics["perf/total_num_tokens"] = total_tokens
        metrics["perf/step_s"] = step_s
        metrics["perf/tokens_per_s"] = total_tokens / step_s if step_s > 0 else 0.0
        if dev.type == "cuda":
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
        return metrics

    def _update(self, rows: torch.Tensor, data: _StepTensors, acc: _UpdateMetrics, critic: bool) -> None:
        """One optimiser step on a mini-batch: this rank's share, micro-batched, global token counts."""
        alg, opt = self.cfg.algorithm, self.cfg.optim
        mask_mb = data.mask[rows]
        global_tokens = mask_mb.sum()  # every rank holds the whole batch: these are the global counts
        global_seqs = mask_mb.any(dim=1).sum()
        lo, hi = _split(rows.shape[0], self.world_size)[self.rank]
        local = rows[lo:hi]
        prefix = "critic" if critic else "actor"
        optim = self.critic_optim if critic else self.actor_optim
        params = self.critic_params if critic else self.actor_params
        assert optim is not None
        optim.zero_grad(set_to_none=True)
        if critic:
            per_update = ["critic/vf_loss"]
            per_token = ["critic/vf_clipfrac", "critic/vpred_mean"]
        else:
            per_update = ["actor/pg_loss"] + (["actor/kl_loss"] if alg.use_kl_loss else [])
            per_token = ["actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"]
        acc.declare(
            per_update=[*per_update, f"{prefix}/grad_norm"],
            per_token=per_token,
            counts=[f"{prefix}/tokens", f"{prefix}/skipped_steps", f"{prefix}/updates"],
        )
        for start in range(0, local.shape[0], opt.micro_batch_size):
            idx = local[start : start + opt.micro_batch_size]
            width = int(data.lengths[idx].max())
            ids = data.input_ids[idx, :width]
            mask = data.mask[idx, :width]
            n_tok = float(mask.sum())
            if critic:
                assert data.values is not None  # a critic's step computed them
                vpred = self._values(ids)
                loss, m = value_loss(
                    vpred,
                    data.values[idx, :width],
                    data.returns[idx, :width],
                    mask,
                    clip=alg.value_clip,
                    agg=alg.loss_agg_mode,
                    global_token_count=global_tokens,
                    global_seq_count=global_seqs,
                )
                acc.add("critic/vf_loss", loss.detach())
                acc.add_token_mean("critic/vf_clipfrac", m["vf_clipfrac"], n_tok)
                acc.add_token_mean("critic/vpred_mean", masked_mean(vpred.detach(), mask), n_tok)
            else:
                logp, entropy = self._logprobs(
                    self.policy,
                    ids,
                    mask,
                    with_entropy=True,
                    entropy_grad=alg.entropy_coeff != 0,
                    allowed=None if data.allowed is None else data.allowed[idx, :width],
                )
                if data.old_logp_from_update:
                    data.old_logp[idx, :width] = logp.detach() * mask
                pg_loss, m = policy_loss(
                    logp,
                    data.old_logp[idx, :width],
                    data.advantages[idx, :width],
                    mask,
                    clip_low=alg.clip_low,
                    clip_high=alg.clip_high,
                    dual_clip=alg.dual_clip,
                    agg=alg.loss_agg_mode,
                    global_token_count=global_tokens,
                    global_seq_count=global_seqs,
                )
                assert entropy is not None
                ent = agg_loss(entropy, mask, alg.loss_agg_mode, global_tokens, global_seqs)
                loss = pg_loss - alg.entropy_coeff * ent if alg.entropy_coeff != 0 else pg_loss
                if alg.use_kl_loss:
                    assert data.ref_logp is not None  # a KL term computes the reference log-probs
                    kl = kl_penalty(logp, data.ref_logp[idx, :width], alg.kl_loss_type)
                    kl_loss = agg_loss(kl, mask, alg.loss_agg_mode, global_tokens, global_seqs)
                    loss = loss + alg.kl_loss_coef * kl_loss
                    acc.add("actor/kl_loss", kl_loss.detach())
                acc.add("actor/pg_loss", pg_loss.detach())
                acc.add_token_mean("actor/entropy", masked_mean(entropy.detach(), mask), n_tok)
                acc.add_token_mean("actor/pg_clipfrac", m["clipfrac"], n_tok)
                acc.add_token_mean("actor/pg_clipfrac_lower", m["clipfrac_lower"], n_tok)
                acc.add_token_mean("actor/ppo_kl", m["approx_kl"], n_tok)
            acc.count(f"{prefix}/tokens", n_tok)
            loss.backward()
        self._allreduce_grads(params)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, opt.grad_clip)
        if torch.isfinite(grad_norm):
            optim.step()
        else:
            acc.count(f"{prefix}/skipped_steps", 1.0 / self.world_size)
            if not critic:
                self.skipped_steps += 1
        optim.zero_grad(set_to_none=True)
        if self.rank == 0:  # identical on every rank; count it once in the reduced sums
            acc.add(f"{prefix}/grad_norm", grad_norm.detach())
            acc.count(f"{prefix}/updates", 1.0)

    def _allreduce_grads(self, params: list[nn.Parameter], bucket_elems: int = 2**25) -> None:
        """Sum gradients over the data-parallel group (flat buckets; a missing grad counts as 0)."""
        if self.world_size == 1:
            return
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

    # ---------------------------------------------------------------- metrics

    def _metrics(
        self,
        sums: _UpdateMetrics,
        data: _StepTensors,
        scores: torch.Tensor,
        token_rewards: torch.Tensor,
        maskf: torch.Tensor,
        batch: TokenBatch,
        ref_logp: torch.Tensor | None,
    ) -> dict[str, float]:
        """The step's metrics under their logged names: the updates' sums (``sums``, reduced across
        ranks) as means over updates or over trained tokens, then statistics of the batch."""
        out: dict[str, float] = {}
        for prefix in ("actor", "critic"):
            updates = sums.counts.get(f"{prefix}/updates", 0.0)
            tokens = sums.counts.get(f"{prefix}/tokens", 0.0)
            if updates == 0:
                continue
            mine = prefix + "/"
            out.update({k: v / updates for k, v in sums.per_update.items() if k.startswith(mine)})
            out.update({k: v / max(tokens, 1.0) for k, v in sums.per_token.items() if k.startswith(mine)})
            out[f"{prefix}/skipped_steps"] = round(sums.counts.get(f"{prefix}/skipped_steps", 0.0))
        out["actor/entropy_loss"] = out.get("actor/entropy", 0.0)  # RAGEN's name for the same number
        out["actor/lr"] = self.actor_optim.param_groups[0]["lr"]
        if self.critic_optim is not None:
            out["critic/lr"] = self.critic_optim.param_groups[0]["lr"]
        if self.cfg.algorithm.use_kl_loss:
            out["actor/kl_coef"] = self.cfg.algorithm.kl_loss_coef
        mask = maskf != 0

        def stats(name: str, x: torch.Tensor) -> None:
            sel = x[mask] if x.dim() == 2 else x
            out[f"{name}/mean"] = float(sel.mean())
            out[f"{name}/max"] = float(sel.max())
            out[f"{name}/min"] = float(sel.min())

        stats("critic/score", scores)
        stats("critic/rewards", token_rewards.sum(dim=1))
        stats("critic/advantages", data.advantages)
        stats("critic/returns", data.returns)
        if data.values is not None:
            values, returns = data.values, data.returns
            stats("critic/values", values)
            var_ret = torch.var(returns[mask])
            out["critic/vf_explained_var"] = float(
                1.0 - torch.var((returns - values)[mask]) / (var_ret + 1e-5)
            )
        out["rollout/old_log_prob"] = float(masked_mean(data.old_logp, maskf))
        if ref_logp is not None:
            out["rollout/ref_log_prob"] = float(masked_mean(ref_logp, maskf))
        if self.cfg.algorithm.use_kl_in_reward:
            # use_kl_in_reward implies use_ref: ref_logp is set
            kl = kl_penalty(data.old_logp, cast(torch.Tensor, ref_logp), self.cfg.algorithm.kl_in_reward_type)
            out["actor/reward_kl_penalty"] = float(masked_mean(kl, maskf))
            out["actor/reward_kl_penalty_coeff"] = self.cfg.algorithm.kl_coef
        rollout_logp = getattr(batch, "rollout_logprobs", None)
        if rollout_logp is not None:
            rl = rollout_logp[:, : maskf.shape[1]].to(maskf.device, maskf.dtype)
            if bool((rl[mask] != 0).any()):
                gap = (data.old_logp - rl).abs()
                out["rollout/old_vs_rollout_logprob_diff"] = float(masked_mean(gap, maskf))
                out["rollout/old_vs_rollout_logprob_max_diff"] = float(gap[mask].max())
        per_seq = maskf.sum(dim=1)
        out["response_length/mean"] = float(per_seq.mean())
        out["response_length/max"] = float(per_seq.max())
        out["response_length/min"] = float(per_seq.min())
        return out

    # ---------------------------------------------------------------- weights and checkpoints

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full policy weights on CPU under the plain model's names (LoRA merged in), for rollout actors."""
        if not self.lora:
            return {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        base = cast("PeftModel", self.policy).get_base_model()
        out: dict[str, torch.Tensor] = {}
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                weight = cast(torch.Tensor, module.get_base_layer().weight).detach()
                # peft defines get_delta_weight on each concrete LoraLayer (Linear, ...), not the base
                delta = sum(
                    module.get_delta_weight(a)  # type: ignore[attr-defined]
                    for a in module.active_adapters
                    if a in module.lora_A
                )
                out[f"{name}.weight"] = (weight + delta).cpu().clone()
                bias = getattr(module.get_base_layer(), "bias", None)
                if bias is not None:
                    out[f"{name}.bias"] = bias.detach().cpu().clone()
        for key, value in base.state_dict().items():
            if "lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            out.setdefault(plain, value.detach().cpu().clone())
        return out

    def save_checkpoint(
        self, path: str | os.PathLike[str], iteration: int, extra: dict[str, Any] | None = None
    ) -> Path:
        """Write everything needed to resume into ``path`` atomically (``ragen_core.learner.checkpoint``
        describes the layout); ``extra`` is stored in the manifest. An ``OSError`` (full disk) is
        raised as ``StorageWriteError`` naming the checkpoint."""
        training_state = {
            "actor_optim": self.actor_optim.state_dict(),
            "actor_sched": self.actor_sched.state_dict(),
            "critic_optim": None if self.critic_optim is None else self.critic_optim.state_dict(),
            "critic_sched": None if self.critic_sched is None else self.critic_sched.state_dict(),
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
        }
        return write_checkpoint(
            path,
            iteration,
            policy=self.policy,
            critic=self.critic,
            training_state=training_state,
            cfg=self.cfg,
            extra=extra,
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore a ``save_checkpoint`` directory; returns ``{"iteration", "global_step", "extra"}``.

        Everything is read and checked before anything is changed (``checkpoint.read_checkpoint``):
        a damaged file, a checkpoint of another model or a missing / unreadable file raises
        ``CheckpointError`` naming it and leaves this learner as it was.
        """
        ckpt = read_checkpoint(
            path,
            policy=self.policy,
            critic=self.critic,
            cfg=self.cfg,
            actor_optim=self.actor_optim,
            critic_optim=self.critic_optim,
        )
        # Everything is readable and fits: apply.
        with torch.no_grad():
            if self.lora:
                import peft

                peft.set_peft_model_state_dict(self.policy, ckpt.policy)
            else:
                load_into(self.policy, ckpt.policy)
            if self.critic is not None:
                load_into(self.critic, cast("dict[str, torch.Tensor]", ckpt.critic))  # read with the critic
        state = ckpt.training_state
        self.actor_optim.load_state_dict(state["actor_optim"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        if self.critic_optim is not None:
            self.critic_optim.load_state_dict(state["critic_optim"])
            # built with critic_optim
            cast(torch.optim.lr_scheduler.LRScheduler, self.critic_sched).load_state_dict(
                state["critic_sched"]
            )
        self.global_step = int(state["global_step"])
        self.skipped_steps = int(state["skipped_steps"])
        set_rng_state(ckpt.rng)
        return {
            "iteration": ckpt.manifest["iteration"],
            "global_step": self.global_step,
            "extra": ckpt.manifest["extra"],
        }


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (helper for tests and scripts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
