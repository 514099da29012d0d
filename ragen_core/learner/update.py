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
4. advantages with the configured estimator of ``ragen_core.algorithms.registry`` (GAE + whitening,
   bi-level GAE, GRPO, RLOO, REINFORCE++, or a registered one), then RAGEN-2's advantage options (soft
   reweighting, length weighting, zeroing), times ``advantage_scale`` (``rollout.filter.loss_scaling``);
5. the critic update (first, as veRL), then the actor update with the configured policy loss of
   the registry: ``ppo_epochs`` x mini-batches, each
   mini-batch split into micro-batches whose gradients are accumulated with the mini-batch's
   *global* token counts (so the result does not depend on ``micro_batch_size`` nor, in a
   data-parallel group, on the number of learners), gradient clipping (the pre-clip norm is
   reported), and a skipped optimiser step when the gradient norm is not finite;
6. metrics with RAGEN / veRL names (docs/metrics.md).

Every per-token tensor is indexed by the *target* position (``ragen_core.learner.forward``, which
also holds the forward passes).

Data parallelism: when ``torch.distributed`` is initialised with more than one process, every
learner receives the whole batch, computes old log-probs / values for its contiguous share of the
rows (then all-reduced), computes the same advantages, and trains on its contiguous share of each
mini-batch; gradients are summed with an all-reduce, so every rank takes the same optimiser step.
Parameters are broadcast from rank 0 at construction. See ``ragen_core.learner.actors``.

The learner's config is ``ragen_core.config.learner``, its critic ``ragen_core.learner.critic``, the
checkpoint files it saves and loads ``ragen_core.learner.checkpoint``, the rewards and advantages
``ragen_core.learner.advantage``, the metrics ``ragen_core.learner.metrics``; this module holds the
update itself.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ragen_core.algorithms import (
    POLICY_LOSSES,
    PolicyLossInputs,
    agg_loss,
    kl_penalty,
    masked_mean,
    value_loss,
)
from ragen_core.config.learner import LearnerConfig
from ragen_core.learner.advantage import advantages, token_rewards
from ragen_core.learner.batch import BadBatchError, TokenBatch, check_batch
from ragen_core.learner.checkpoint import load_learner, merged_policy_state, save_learner
from ragen_core.learner.critic import ValueModel, build_critic
from ragen_core.learner.forward import (
    StepTensors,
    infer_rows,
    prompt_response_rows,
    rows_of,
    token_logprobs,
    token_values,
)
from ragen_core.learner.metrics import UpdateMetrics, step_metrics
from ragen_core.learner.parallel import allreduce_grads, broadcast_parameters, split

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["BadBatchError", "Learner", "seed_everything"]


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
            broadcast_parameters(self.policy, self.critic, self.ref)

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
        segments: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward.token_logprobs`` of ``model`` under this learner's autocast."""
        return token_logprobs(
            model,
            input_ids,
            mask,
            self._autocast(),
            with_entropy,
            entropy_grad,
            allowed,
            shared_prefix=self.cfg.shared_prefix,
            segments=segments,
        )

    def _values(self, input_ids: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        assert self.critic is not None
        return token_values(self.critic, input_ids, self._autocast(), segments)

    def _infer(
        self,
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor],
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        lengths: torch.Tensor,
        dtype: torch.dtype,
        allowed: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward.infer_rows`` over this rank's share of the rows, in micro-batches."""
        mbs = self.cfg.optim.micro_batch_size
        return infer_rows(
            fn, input_ids, mask, lengths, dtype, mbs, self.rank, self.world_size, allowed, segments
        )

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
        input_ids, mask, lengths = prompt_response_rows(prompts, responses)
        fdtype = torch.promote_types(next(self.policy.parameters()).dtype, torch.float32)
        logp = self._infer(
            lambda ids, m, a, s: self._logprobs(self.policy, ids, m)[0],
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

    # ---------------------------------------------------------------- the step

    def step(
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
        alg = self.cfg.algorithm
        timing: dict[str, float] = {}

        # 1. old log-probs, reference log-probs, values (no grad) --------------------------------
        data, scores = self._step_tensors(batch, behaviour_logprobs, timing)

        # 2. token rewards: the (normalised) score on the last trained token, or each trained turn's
        #    score on its last token (use_turn_scores); - KL penalty ----------------------------------
        t = time.perf_counter()
        rewards, kl_in_reward = token_rewards(
            batch, alg, scores, data.mask, turn_scores, data.old_logp, data.ref_logp
        )

        # 3. advantages, then RAGEN-2's options on them ----------------------------------------------
        adv = advantages(
            batch, alg, rewards, kl_in_reward, data.values, data.mask, turn_scores, advantage_scale
        )
        data.advantages, data.returns = adv.advantages, adv.returns
        timing["adv"] = time.perf_counter() - t

        # 4.-5. mini-batches, critic then actor updates ---------------------------------------------
        acc = self._train(data, timing)

        # 6. metrics ---------------------------------------------------------------------------------
        acc.reduce(self.world_size, self.device)
        lrs = {"actor/lr": self.actor_optim.param_groups[0]["lr"]}
        if self.critic_optim is not None:
            lrs["critic/lr"] = self.critic_optim.param_groups[0]["lr"]
        metrics = step_metrics(acc, data, scores, rewards, batch, alg, lrs)
        metrics.update(adv.metrics)
        step_s = time.perf_counter() - t_start
        for k, v in timing.items():
            metrics[f"timing_s/{k}"] = v
        metrics["timing_s/step"] = step_s
        total_tokens = float(data.lengths.sum())
        metrics["perf/total_num_tokens"] = total_tokens
        metrics["perf/step_s"] = step_s
        metrics["perf/tokens_per_s"] = total_tokens / step_s if step_s > 0 else 0.0
        if self.device.type == "cuda":
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def _n_mini(self, n_seq: int) -> int:
        """Mini-batches per epoch: floor(B / mini_batch_size), at least one."""
        return max(1, n_seq // self.cfg.optim.mini_batch_size)

    def _step_tensors(
        self, batch: TokenBatch, behaviour_logprobs: bool, timing: dict[str, float]
    ) -> tuple[StepTensors, torch.Tensor]:
        """The step's tensors on the device (trimmed to the longest row) with the old log-probs, the
        reference log-probs (only with a KL term) and the critic's values (only with a critic), and
        the trajectory scores; the advantages and returns are left for the estimator."""
        alg, opt, dev = self.cfg.algorithm, self.cfg.optim, self.device
        lengths = batch.attention_mask.sum(dim=1).to(dev)
        width = int(lengths.max())
        input_ids = batch.input_ids[:, :width].to(dev, torch.long)
        mask = (batch.loss_mask[:, :width] != 0).to(dev)
        fdtype = torch.promote_types(next(self.policy.parameters()).dtype, torch.float32)
        maskf = mask.to(fdtype)
        allowed, segments = (  # the optional per-token tensors, trimmed and moved like the others
            None if x is None else x[:, :width].to(dev)
            for x in (getattr(batch, "allowed_token_ids", None), getattr(batch, "segments", None))
        )
        # One update on the whole batch from the current weights: its own forward pass gives the old
        # log-probs (filled in by _update before the loss reads them).
        from_update = (
            opt.old_logprobs_from_update
            and not behaviour_logprobs
            and opt.ppo_epochs == 1
            and self._n_mini(mask.shape[0]) == 1
            and self.world_size == 1
            and not alg.use_kl_in_reward
        )
        empty = torch.zeros_like(maskf)  # the estimator's outputs, filled in by the step
        data = StepTensors(
            input_ids, mask, lengths, maskf, None, None, empty, empty, from_update, allowed, segments
        )
        data.old_logp = self._old_logprobs(batch, data, behaviour_logprobs, timing)
        if alg.use_ref:
            t = time.perf_counter()
            with self._ref_policy() as ref:
                data.ref_logp = self._infer(
                    lambda ids, m, a, s: self._logprobs(ref, ids, m, allowed=a, segments=s)[0],
                    input_ids,
                    mask,
                    lengths,
                    fdtype,
                    allowed,
                    segments,
                )
            timing["ref"] = time.perf_counter() - t
        if self.critic is not None:
            t = time.perf_counter()
            values = self._infer(
                lambda ids, m, a, s: self._values(ids, s), input_ids, mask, lengths, fdtype, segments=segments
            )
            data.values = values * maskf
            timing["values"] = time.perf_counter() - t
        return data, batch.scores.to(dev, fdtype)

    def _old_logprobs(
        self, batch: TokenBatch, data: StepTensors, behaviour_logprobs: bool, timing: dict[str, float]
    ) -> torch.Tensor:
        """The PPO ratio's old log-probs: the batch's own (``behaviour_logprobs``), zeros the single
        update fills in (``data.old_logp_from_update``), or the current policy's (no grad)."""
        maskf = data.old_logp  # _step_tensors passes the float mask here
        if behaviour_logprobs:
            old_logp = batch.rollout_logprobs[:, : data.mask.shape[1]].to(self.device, maskf.dtype) * maskf
            if not bool((old_logp[data.mask] != 0).any()):
                raise ValueError(
                    "trainer.off_policy_steps needs the rollouts' log-probs, and this batch has none (all 0): "
                    "use a rollout engine that returns them (hf and vllm both do), or trainer.off_policy_steps=0"
                )
            return old_logp
        if data.old_logp_from_update:
            return torch.zeros_like(maskf)
        t = time.perf_counter()
        old_logp = self._infer(
            lambda ids, m, a, s: self._logprobs(self.policy, ids, m, allowed=a, segments=s)[0],
            data.input_ids,
            data.mask,
            data.lengths,
            maskf.dtype,
            data.allowed,
            data.segments,
        )
        timing["old_log_prob"] = time.perf_counter() - t
        return old_logp

    def _train(self, data: StepTensors, timing: dict[str, float]) -> UpdateMetrics:
        """``ppo_epochs`` x floor(B / mini) contiguous near-equal mini-batches (shuffled per epoch with
        ``optim.shuffle``): the critic's updates first (as veRL), then the actor's."""
        opt, dev = self.cfg.optim, self.device
        n_seq = data.mask.shape[0]
        epochs_rows = []
        for epoch in range(opt.ppo_epochs):
            if opt.shuffle:
                gen = torch.Generator().manual_seed(
                    self.cfg.seed * 1_000_003 + self.global_step * 1009 + epoch
                )
                order = torch.randperm(n_seq, generator=gen).to(dev)
            else:
                order = torch.arange(n_seq, device=dev)
            epochs_rows.append([order[a:b] for a, b in split(n_seq, self._n_mini(n_seq))])
        acc = UpdateMetrics()
        roles = ([True] if self.critic is not None else []) + [False]
        for critic in roles:
            t = time.perf_counter()
            for minibatches in epochs_rows:
                for rows in minibatches:
                    self._update(rows, data, acc, critic=critic)
            timing["update_critic" if critic else "update_actor"] = time.perf_counter() - t
        # constant LR; stepped once per learner step (after an optimiser step, as torch expects)
        if self.actor_optim.state:
            self.actor_sched.step()
        if self.critic_sched is not None and self.critic_optim is not None and self.critic_optim.state:
            self.critic_sched.step()
        self.global_step += 1
        return acc

    def _update(self, rows: torch.Tensor, data: StepTensors, acc: UpdateMetrics, critic: bool) -> None:
        """One optimiser step on a mini-batch: this rank's share, micro-batched, global token counts."""
        opt = self.cfg.optim
        mask_mb = data.mask[rows]
        global_tokens = mask_mb.sum()  # every rank holds the whole batch: these are the global counts
        global_seqs = mask_mb.any(dim=1).sum()
        lo, hi = split(rows.shape[0], self.world_size)[self.rank]
        local = rows[lo:hi]
        prefix = "critic" if critic else "actor"
        optim = self.critic_optim if critic else self.actor_optim
        params = self.critic_params if critic else self.actor_params
        assert optim is not None
        optim.zero_grad(set_to_none=True)
        acc.declare_role(prefix, kl_loss=self.cfg.algorithm.use_kl_loss)
        micro_loss = self._critic_loss if critic else self._actor_loss
        for start in range(0, local.shape[0], opt.micro_batch_size):
            idx = local[start : start + opt.micro_batch_size]
            width = int(data.lengths[idx].max())
            n_tok = float(data.mask[idx, :width].sum())
            loss = micro_loss(data, idx, width, (global_tokens, global_seqs), acc, n_tok)
            acc.count(f"{prefix}/tokens", n_tok)
            loss.backward()
        if self.world_size > 1:
            allreduce_grads(params)
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

    def _critic_loss(
        self,
        data: StepTensors,
        idx: torch.Tensor,
        width: int,
        counts: tuple[torch.Tensor, torch.Tensor],
        acc: UpdateMetrics,
        n_tok: float,
    ) -> torch.Tensor:
        """A micro-batch's share of the mini-batch's clipped value loss (``counts``: its global token
        and sequence counts)."""
        alg = self.cfg.algorithm
        assert data.values is not None  # a critic's step computed them
        mask = data.mask[idx, :width]
        vpred = self._values(data.input_ids[idx, :width], rows_of(data.segments, idx, width))
        loss, m = value_loss(
            vpred,
            data.values[idx, :width],
            data.returns[idx, :width],
            mask,
            clip=alg.value_clip,
            agg=alg.loss_agg_mode,
            global_token_count=counts[0],
            global_seq_count=counts[1],
        )
        acc.add("critic/vf_loss", loss.detach())
        acc.add_token_mean("critic/vf_clipfrac", m["vf_clipfrac"], n_tok)
        acc.add_token_mean("critic/vpred_mean", masked_mean(vpred.detach(), mask), n_tok)
        return loss

    def _actor_loss(
        self,
        data: StepTensors,
        idx: torch.Tensor,
        width: int,
        counts: tuple[torch.Tensor, torch.Tensor],
        acc: UpdateMetrics,
        n_tok: float,
    ) -> torch.Tensor:
        """A micro-batch's share of the mini-batch's actor loss: the configured policy loss, minus the
        entropy bonus, plus the KL loss when on (``counts``: the global token and sequence counts)."""
        alg = self.cfg.algorithm
        mask = data.mask[idx, :width]
        logp, entropy = self._logprobs(
            self.policy,
            data.input_ids[idx, :width],
            mask,
            with_entropy=True,
            entropy_grad=alg.entropy_coeff != 0,
            allowed=rows_of(data.allowed, idx, width),
            segments=rows_of(data.segments, idx, width),
        )
        if data.old_logp_from_update:
            data.old_logp[idx, :width] = logp.detach() * mask
        pg_loss, m = POLICY_LOSSES[alg.policy_loss].fn(
            PolicyLossInputs(
                logp, data.old_logp[idx, :width], data.advantages[idx, :width], mask, *counts, settings=alg
            )
        )
        assert entropy is not None
        ent = agg_loss(entropy, mask, alg.loss_agg_mode, *counts)
        loss = pg_loss - alg.entropy_coeff * ent if alg.entropy_coeff != 0 else pg_loss
        if alg.use_kl_loss:
            assert data.ref_logp is not None  # a KL term computes the reference log-probs
            kl = kl_penalty(logp, data.ref_logp[idx, :width], alg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, alg.loss_agg_mode, *counts)
            loss = loss + alg.kl_loss_coef * kl_loss
            acc.add("actor/kl_loss", kl_loss.detach())
        acc.add("actor/pg_loss", pg_loss.detach())
        acc.add_token_mean("actor/entropy", masked_mean(entropy.detach(), mask), n_tok)
        acc.add_token_mean("actor/pg_clipfrac", m["clipfrac"], n_tok)
        acc.add_token_mean("actor/pg_clipfrac_lower", m["clipfrac_lower"], n_tok)
        acc.add_token_mean("actor/ppo_kl", m["approx_kl"], n_tok)
        return loss

    # ---------------------------------------------------------------- weights and checkpoints

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Full policy weights on CPU under the plain model's names (LoRA merged in), for rollout actors."""
        return merged_policy_state(self.policy, self.lora)

    def save_checkpoint(
        self, path: str | os.PathLike[str], iteration: int, extra: dict[str, Any] | None = None
    ) -> Path:
        """Write everything needed to resume into ``path`` atomically (``checkpoint.save_learner``)."""
        return save_learner(self, path, iteration, extra)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore a ``save_checkpoint`` directory (``checkpoint.load_learner``); returns ``{"iteration",
        "global_step", "extra"}``. A damaged or foreign checkpoint leaves this learner as it was."""
        return load_learner(self, path)


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (helper for tests and scripts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
