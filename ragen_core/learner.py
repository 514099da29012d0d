"""The learner: one PPO / GRPO / StarPO update of a policy (and its critic) on a batch of trajectories.

``Learner.step(batch)`` reads top to bottom like veRL's / CleanRL's update (docs/architecture.md,
"Learner step"):

1. check the batch (nothing is modified when it is bad);
2. old log-probs of the sampled tokens under the current policy (no grad, temperature 1), the
   reference policy's log-probs (only when a KL term is on) and the critic's values (only for GAE);
3. token rewards: the trajectory score on its last trained token (docs/architecture.md, "Trajectory
   schema"), minus ``kl_coef`` x KL(old || ref) on every trained token when ``use_kl_in_reward``;
4. advantages with ``ragen_core.algorithms`` (GAE + whitening, bi-level GAE, GRPO, RLOO,
   REINFORCE++);
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
Parameters are broadcast from rank 0 at construction. See ``ragen_core.actors``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from ragen_core.algorithms import (
    AGG_MODES,
    KL_KINDS,
    agg_loss,
    bilevel_gae,
    gae,
    grpo,
    kl_penalty,
    masked_mean,
    policy_loss,
    reinforce_pp,
    rloo,
    value_loss,
    whiten,
)
from ragen_core.faults import crash_point
from ragen_core.integrity import sha256_file
from ragen_core.storage import as_os_error, write_error

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = [
    "AlgorithmConfig",
    "BadBatchError",
    "CheckpointError",
    "Learner",
    "LearnerConfig",
    "LoraConfig",
    "OptimConfig",
    "ValueModel",
    "manifest_digest",
    "seed_everything",
    "verify_checkpoint",
]

_T = TypeVar("_T")

CHECKPOINT_FORMAT = 1
_MANIFEST = "manifest.json"


class BadBatchError(ValueError):
    """A batch the learner cannot train on; the message says what is wrong and how to fix it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this learner (missing, corrupt, or another model)."""

    user_error = True


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


class AlgorithmConfig(BaseModel):
    """Advantage estimator, losses and KL terms (defaults of RAGEN's base.yaml; docs/architecture.md,
    "Learner step")."""

    model_config = ConfigDict(extra="forbid")

    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = Field(
        default="gae",
        description="gae: PPO with a critic; grpo: group-normalised score; rloo: leave-one-out "
        "baseline; reinforce_pp: REINFORCE++ (whitened discounted returns, no critic)",
    )
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="discount over trained tokens")
    lam: float = Field(default=1.0, ge=0.0, le=1.0, description="GAE lambda")
    bi_level_gae: bool = Field(
        default=False, description="turn-level GAE (needs adv_estimator=gae); turns from turn_index"
    )
    high_level_gamma: float = Field(
        default=0.95, ge=0.0, le=1.0, description="discount across turns for bi-level GAE"
    )
    norm_adv_by_std: bool = Field(
        default=True,
        description="GRPO: divide by the group std (+1e-6). With shaped rewards (Sokoban's -0.1 per step) this "
        "scales the small differences inside all-fail groups up to full-size advantages (measured: the policy "
        "learns to act less); false is Dr. GRPO's unscaled advantage",
    )
    whiten_advantages: bool = Field(
        default=True, description="gae / bi-level gae: whiten advantages over the batch's trained tokens"
    )
    clip_low: float = Field(default=0.2, gt=0.0, lt=1.0, description="PPO ratio clip below: 1 - clip_low")
    clip_high: float = Field(default=0.28, gt=0.0, description="PPO ratio clip above: 1 + clip_high")
    dual_clip: float | None = Field(
        default=3.0, description="dual-clip constant c (> 1) for negative advantages; None disables"
    )
    value_clip: float | None = Field(
        default=0.5, gt=0.0, description="critic value clip around the old values; None disables"
    )
    loss_agg_mode: str = Field(
        default="token-mean",
        description="token-mean (over all trained tokens of the mini-batch), seq-mean-token-mean "
        "(RAGEN's effective aggregation), seq-mean-token-sum",
    )
    entropy_coeff: float = Field(default=0.001, ge=0.0, description="entropy bonus coefficient")
    use_kl_loss: bool = Field(default=False, description="add kl_loss_coef x KL(pi || ref) to the actor loss")
    kl_loss_coef: float = Field(default=0.0, ge=0.0, description="coefficient of the KL loss")
    kl_loss_type: str = Field(default="k1", description="KL estimator of the KL loss: k1, abs, k2, k3")
    use_kl_in_reward: bool = Field(
        default=False, description="subtract kl_coef x KL(pi_old || ref) from every trained token's reward"
    )
    kl_coef: float = Field(default=0.0, ge=0.0, description="coefficient of the in-reward KL penalty")
    kl_in_reward_type: str = Field(default="k1", description="KL estimator of the in-reward penalty")

    @field_validator("loss_agg_mode")
    @classmethod
    def _agg(cls, v: str) -> str:
        if v not in AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode={v!r} is unknown; use one of {', '.join(AGG_MODES)}")
        return v

    @field_validator("kl_loss_type", "kl_in_reward_type")
    @classmethod
    def _kl(cls, v: str) -> str:
        if v not in KL_KINDS:
            raise ValueError(f"unknown KL estimator {v!r}; use one of {', '.join(KL_KINDS)}")
        return v

    @field_validator("dual_clip")
    @classmethod
    def _dual(cls, v: float | None) -> float | None:
        if v is not None and v <= 1.0:
            raise ValueError(f"algorithm.dual_clip must be > 1 (or null to disable), got {v}")
        return v

    @model_validator(mode="after")
    def _combos(self) -> AlgorithmConfig:
        if self.bi_level_gae and self.adv_estimator != "gae":
            raise ValueError(
                f"algorithm.bi_level_gae=true needs algorithm.adv_estimator=gae (got {self.adv_estimator!r})"
            )
        return self

    @property
    def use_critic(self) -> bool:
        return self.adv_estimator == "gae"

    @property
    def use_ref(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward


class OptimConfig(BaseModel):
    """Optimisers and batching (veRL defaults; docs/architecture.md, "Learner step")."""

    model_config = ConfigDict(extra="forbid")

    actor_lr: float = Field(default=1e-6, gt=0.0, description="actor AdamW learning rate (constant)")
    critic_lr: float = Field(default=1e-5, gt=0.0, description="critic AdamW learning rate (constant)")
    weight_decay: float = Field(default=0.01, ge=0.0, description="AdamW weight decay (actor and critic)")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    eps: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon")
    grad_clip: float = Field(default=1.0, gt=0.0, description="max global L2 gradient norm")
    ppo_epochs: int = Field(default=1, ge=1, description="passes over the batch per step")
    mini_batch_size: int = Field(
        default=32,
        ge=1,
        description="trajectories per optimiser step (whole data-parallel group); the batch is cut "
        "into floor(B / mini_batch_size) contiguous mini-batches of near-equal size",
    )
    micro_batch_size: int = Field(
        default=4, ge=1, description="sequences per forward/backward pass on one learner (memory only)"
    )
    shuffle: bool = Field(
        default=False, description="shuffle rows before each epoch (seeded by learner.seed)"
    )
    old_logprobs_from_update: bool = Field(
        default=False,
        description="when a step makes a single update (ppo_epochs 1, one mini-batch, one learner, no KL in the "
        "reward), take the old log-probs from that update's own forward pass (detached: ratio 1, the same "
        "gradient) instead of a separate no-grad pass over the batch: one forward pass fewer per step",
    )
    critic: Literal["separate", "shared_backbone"] = Field(
        default="separate",
        description="separate: a copy of the policy backbone (or critic_model_path) + a fresh scalar "
        "head, trained with critic_lr; shared_backbone: a scalar head on the policy's own (detached) "
        "last hidden state, only the head is trained",
    )
    critic_model_path: str | None = Field(
        default=None, description="separate critic: load its backbone from this path instead of the policy"
    )


class LoraConfig(BaseModel):
    """LoRA on the policy through peft (rank 0 = off). The reference policy is then the adapter-disabled model."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=0, ge=0, description="LoRA rank; 0 trains all weights")
    alpha: int = Field(default=16, ge=1, description="LoRA alpha (scale alpha / rank)")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    target_modules: str | list[str] = Field(
        default="all-linear", description="peft target_modules: 'all-linear' or module names"
    )


class LearnerConfig(BaseModel):
    """Everything the learner needs besides the models."""

    model_config = ConfigDict(extra="forbid")

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="estimator and losses")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimisers and batching")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA (off by default)")
    num_gpus: float = Field(default=0, ge=0, description="GPUs per learner actor: 0 on CPU, 1 on a GPU node")
    num_cpus: float = Field(default=1, gt=0, description="CPUs per learner actor")
    bf16_autocast_on_gpu: bool = Field(
        default=True, description="bf16 autocast for forward passes on GPU (weights stay fp32)"
    )
    seed: int = Field(default=0, description="seeds the critic head's initialisation and the shuffle")


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def _backbone(model: nn.Module) -> nn.Module:
    """The transformer body (no LM head) of a causal LM, also through a peft wrapper."""
    if hasattr(model, "get_base_model"):  # peft
        model = cast("PeftModel", model).get_base_model()
    return cast("PreTrainedModel", model).base_model


class ValueModel(nn.Module):
    """Critic: a scalar head ``nn.Linear(hidden, 1)`` on a transformer's last hidden state.

    ``forward(input_ids) -> (B, L)``: value of the state *after* each position (a token's value is
    read at the position before it, see the module docstring). With ``shared`` the backbone is the
    policy's (not a submodule of the critic: not saved, not trained by the critic; features are
    detached).
    """

    def __init__(
        self,
        backbone: nn.Module,
        hidden_size: int,
        *,
        shared: bool = False,
        seed: int = 0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        param = next(backbone.parameters())
        self.shared = shared
        if shared:
            self._shared_backbone = (backbone,)  # a tuple: not registered as a submodule
        else:
            self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1, device=param.device, dtype=param.dtype)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = torch.randn(self.head.weight.shape, generator=gen, dtype=torch.float64) * init_std
            self.head.weight.copy_(weight)
            self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shared:
            with torch.no_grad():
                hidden = self._shared_backbone[0](input_ids=input_ids, use_cache=False).last_hidden_state
        else:
            hidden = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        return cast(torch.Tensor, self.head(hidden.to(self.head.weight.dtype)).squeeze(-1))


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


class _Accum:
    """Sums of metrics over micro-batches; reduced once across ranks at the end of the step."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}

    def add(self, key: str, value: float | torch.Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def reduce(self, world_size: int, device: torch.device) -> dict[str, float]:
        if world_size > 1 and self.sums:
            keys = sorted(self.sums)
            buf = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64, device=device)
            dist.all_reduce(buf)
            return dict(zip(keys, buf.tolist(), strict=True))
        return dict(self.sums)


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
            self.critic = critic_model if critic_model is not None else self._build_critic(policy)
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

    def _build_critic(self, policy: nn.Module) -> ValueModel:
        opt = self.cfg.optim
        hidden: int = cast("PreTrainedModel", policy).config.hidden_size
        init_std = float(getattr(policy.config, "initializer_range", 0.02))
        if opt.critic == "shared_backbone":
            return ValueModel(_backbone(policy), hidden, shared=True, seed=self.cfg.seed, init_std=init_std)
        if opt.critic_model_path is not None:
            from transformers import AutoModel

            param = next(policy.parameters())
            backbone = AutoModel.from_pretrained(opt.critic_model_path, dtype=param.dtype).to(param.device)
            return ValueModel(backbone, backbone.config.hidden_size, seed=self.cfg.seed, init_std=init_std)
        return ValueModel(copy.deepcopy(_backbone(policy)), hidden, seed=self.cfg.seed, init_std=init_std)

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-prob (and entropy) of each trained target token t from the output at t - 1, shape (b, l).

        Zero outside ``mask``. For the decoder families of ``_HEAD_ONLY_ON_MASK`` the LM head and
        the softmax run only on the trained positions (environment and prompt tokens need no
        vocabulary distribution); other models compute full logits. The entropy comes from the same
        log-softmax, H = -sum_v p_v log p_v (equal to ``algorithms.entropy_from_logits``, sharing the
        log-softmax's backward).
        """
        targets = mask[:, 1:]
        with self._autocast():
            if _model_type(model) in _HEAD_ONLY_ON_MASK:
                hidden = _backbone(model)(input_ids=input_ids, use_cache=False).last_hidden_state
                logits = cast("PreTrainedModel", model).get_output_embeddings()(hidden[:, :-1][targets])
            else:
                logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1][targets]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
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
        fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        lengths: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Run ``fn(ids, mask) -> (b, l)`` over this rank's share of the rows in micro-batches; all-reduce."""
        batch, length = input_ids.shape
        out = torch.zeros(batch, length, dtype=dtype, device=self.device)
        lo, hi = _split(batch, self.world_size)[self.rank]
        mbs = self.cfg.optim.micro_batch_size
        for start in range(lo, hi, mbs):
            end = min(start + mbs, hi)
            width = int(lengths[start:end].max())
            out[start:end, :width] = fn(input_ids[start:end, :width], mask[start:end, :width]).to(dtype)
        if self.world_size > 1:
            dist.all_reduce(out)
        return out

    # ---------------------------------------------------------------- checks

    def _check_batch(self, batch: Any, turn_scores: torch.Tensor | None) -> None:  # noqa: C901 - one independent check per batch field, each with its own message
        names = ("input_ids", "attention_mask", "loss_mask", "turn_index", "scores", "group_ids")
        missing = [n for n in names if getattr(batch, n, None) is None]
        if missing:
            raise BadBatchError(f"batch lacks {missing}; pass a ragen_core.trajectory.TokenBatch")
        n = int(batch.input_ids.shape[0]) if batch.input_ids.dim() >= 1 else 0
        if n == 0:
            raise BadBatchError(
                "0 trajectories after filtering: nothing to train on. Keep more groups (raise "
                "rollout.filter_ratio, the fraction of groups kept) or raise the number of env groups"
            )
        token_fields = ["input_ids", "attention_mask", "loss_mask", "turn_index"]
        if getattr(batch, "rollout_logprobs", None) is not None:
            token_fields.append("rollout_logprobs")
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
        loss_mask = batch.loss_mask != 0
        attention = batch.attention_mask != 0
        if bool((attention[:, 1:] & ~attention[:, :-1]).any()):
            raise BadBatchError("attention_mask must be right-padded (ones, then zeros) in every row")
        if bool((loss_mask & ~attention).any()):
            raise BadBatchError("loss_mask has trained tokens on padding (attention_mask 0)")
        if bool(loss_mask[:, 0].any()):
            raise BadBatchError(
                "loss_mask[:, 0] must be 0: the first token has no context to be sampled from"
            )
        empty = torch.nonzero(~loss_mask.any(dim=1)).flatten().tolist()
        if empty:
            raise BadBatchError(
                f"trajectories {empty[:20]} have no trained token (loss_mask all 0): drop them before the learner"
            )
        vocab = self._vocab_size()
        if vocab is not None:
            ids = batch.input_ids[attention]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise BadBatchError(
                    f"input_ids outside the policy's vocabulary [0, {vocab}): min {int(ids.min())}, "
                    f"max {int(ids.max())}; was the batch made with another tokenizer?"
                )
        if self.cfg.optim.mini_batch_size > n:
            raise BadBatchError(
                f"optim.mini_batch_size={self.cfg.optim.mini_batch_size} is larger than the {n} trajectories "
                f"of this batch (after filtering): set optim.mini_batch_size <= {n}, or keep more "
                "trajectories (raise rollout.filter_ratio, env groups or group size)"
            )
        if turn_scores is not None and self.cfg.algorithm.bi_level_gae:
            if turn_scores.dim() != 2 or turn_scores.shape[0] != n:
                raise BadBatchError(f"turn_scores must be (B={n}, K), got {tuple(turn_scores.shape)}")
            bad = ~torch.isfinite(turn_scores.double())
            if bool(bad.any()):
                rows = torch.nonzero(bad.any(dim=1)).flatten().tolist()[:20]
                raise BadBatchError(f"non-finite reward (turn_scores) in trajectories {rows}")

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

    def _advantages(
        self,
        token_rewards: torch.Tensor,
        kl: torch.Tensor | None,
        values: torch.Tensor | None,
        mask: torch.Tensor,
        batch: Any,
        turn_scores: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        alg = self.cfg.algorithm
        maskf = mask.to(token_rewards.dtype)
        if alg.adv_estimator == "gae":
            assert values is not None
            if alg.bi_level_gae:
                turns = self._dense_turns(batch.turn_index[:, : mask.shape[1]].to(self.device), mask)
                n_turns = int(turns.max()) + 1
                if turn_scores is None:  # the trajectory score on its last trained turn
                    turn_rewards = torch.zeros(
                        mask.shape[0], n_turns, dtype=token_rewards.dtype, device=self.device
                    )
                    last_turn = torch.where(mask, turns, torch.zeros_like(turns)).max(dim=1).values
                    turn_rewards[torch.arange(mask.shape[0], device=self.device), last_turn] = (
                        batch.scores.to(self.device, token_rewards.dtype)
                    )
                else:
                    turn_rewards = torch.zeros(
                        mask.shape[0],
                        max(n_turns, turn_scores.shape[1]),
                        dtype=token_rewards.dtype,
                        device=self.device,
                    )
                    turn_rewards[:, : turn_scores.shape[1]] = turn_scores.to(self.device, token_rewards.dtype)
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

    def step(self, batch: Any, turn_scores: torch.Tensor | None = None) -> dict[str, float]:  # noqa: C901 - the numbered steps of the update, read top to bottom like the paper
        """One learner iteration on ``batch`` (a ``TokenBatch``); returns metrics (floats).

        ``turn_scores`` (B, K): reward of each trajectory's k-th trained turn, for bi-level GAE
        (default: the score on the last turn). Read from ``batch.turn_scores`` when not given.
        """
        t_start = time.perf_counter()
        if turn_scores is None:
            turn_scores = getattr(batch, "turn_scores", None)
        self._check_batch(batch, turn_scores)
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

        # 1. old log-probs, reference log-probs, values (no grad) --------------------------------
        n_mini = max(1, n_seq // opt.mini_batch_size)
        # One update on the whole batch from the current weights: its own forward pass gives the old
        # log-probs (filled in by _update before the loss reads them).
        from_update = (
            opt.old_logprobs_from_update
            and opt.ppo_epochs == 1
            and n_mini == 1
            and self.world_size == 1
            and not alg.use_kl_in_reward
        )
        t = time.perf_counter()
        if from_update:
            old_logp = torch.zeros_like(maskf)
        else:
            old_logp = self._infer(
                lambda ids, m: self._logprobs(self.policy, ids, m)[0], input_ids, mask, lengths, fdtype
            )
            timing["old_log_prob"] = time.perf_counter() - t
        ref_logp = None
        if alg.use_ref:
            t = time.perf_counter()
            with self._ref_policy() as ref:
                ref_logp = self._infer(
                    lambda ids, m: self._logprobs(ref, ids, m)[0], input_ids, mask, lengths, fdtype
                )
            timing["ref"] = time.perf_counter() - t
        values = None
        if self.critic is not None:
            t = time.perf_counter()
            values = self._infer(lambda ids, m: self._values(ids), input_ids, mask, lengths, fdtype) * maskf
            timing["values"] = time.perf_counter() - t

        # 2. token rewards: the score on the last trained token (- KL penalty) -------------------
        t = time.perf_counter()
        positions = torch.arange(mask.shape[1], device=dev)
        last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
        token_rewards = torch.zeros_like(maskf)
        token_rewards[torch.arange(n_seq, device=dev), last] = scores
        kl_in_reward = None
        if alg.use_kl_in_reward:
            assert ref_logp is not None
            kl_in_reward = kl_penalty(old_logp, ref_logp, alg.kl_in_reward_type) * maskf
            token_rewards = token_rewards - alg.kl_coef * kl_in_reward

        # 3. advantages ---------------------------------------------------------------------------
        advantages, returns = self._advantages(token_rewards, kl_in_reward, values, mask, batch, turn_scores)
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
        data = {
            "input_ids": input_ids,
            "mask": mask,
            "lengths": lengths,
            "old_logp": old_logp,
            "ref_logp": ref_logp,
            "values": values,
            "returns": returns,
            "advantages": advantages,
            "old_logp_from_update": from_update,
        }
        acc = _Accum()

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
        sums = acc.reduce(self.world_size, dev)
        metrics = self._metrics(sums, data, scores, token_rewards, maskf, batch, ref_logp)
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

    def _update(self, rows: torch.Tensor, data: dict[str, Any], acc: _Accum, critic: bool) -> None:
        """One optimiser step on a mini-batch: this rank's share, micro-batched, global token counts."""
        alg, opt = self.cfg.algorithm, self.cfg.optim
        mask_mb = data["mask"][rows]
        global_tokens = mask_mb.sum()  # every rank holds the whole batch: these are the global counts
        global_seqs = mask_mb.any(dim=1).sum()
        lo, hi = _split(rows.shape[0], self.world_size)[self.rank]
        local = rows[lo:hi]
        prefix = "critic" if critic else "actor"
        optim = self.critic_optim if critic else self.actor_optim
        params = self.critic_params if critic else self.actor_params
        assert optim is not None
        optim.zero_grad(set_to_none=True)
        # The same keys on every rank (an all-reduce needs equal lengths), even with no local rows.
        if critic:
            keys = ["critic/vf_loss", "critic/vf_clipfrac*", "critic/vpred_mean*"]
        else:
            keys = [
                "actor/pg_loss",
                "actor/entropy*",
                "actor/pg_clipfrac*",
                "actor/pg_clipfrac_lower*",
                "actor/ppo_kl*",
            ] + (["actor/kl_loss"] if alg.use_kl_loss else [])
        for key in [
            *keys,
            f"{prefix}/tokens",
            f"{prefix}/skipped_steps",
            f"{prefix}/grad_norm",
            f"{prefix}/updates",
        ]:
            acc.add(key, 0.0)
        for start in range(0, local.shape[0], opt.micro_batch_size):
            idx = local[start : start + opt.micro_batch_size]
            width = int(data["lengths"][idx].max())
            ids = data["input_ids"][idx, :width]
            mask = data["mask"][idx, :width]
            n_tok = float(mask.sum())
            if critic:
                vpred = self._values(ids)
                loss, m = value_loss(
                    vpred,
                    data["values"][idx, :width],
                    data["returns"][idx, :width],
                    mask,
                    clip=alg.value_clip,
                    agg=alg.loss_agg_mode,
                    global_token_count=global_tokens,
                    global_seq_count=global_seqs,
                )
                acc.add("critic/vf_loss", loss.detach())
                acc.add("critic/vf_clipfrac*", m["vf_clipfrac"] * n_tok)
                acc.add("critic/vpred_mean*", masked_mean(vpred.detach(), mask) * n_tok)
            else:
                logp, entropy = self._logprobs(
                    self.policy, ids, mask, with_entropy=True, entropy_grad=alg.entropy_coeff != 0
                )
                if data["old_logp_from_update"]:
                    data["old_logp"][idx, :width] = logp.detach() * mask
                pg_loss, m = policy_loss(
                    logp,
                    data["old_logp"][idx, :width],
                    data["advantages"][idx, :width],
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
                    kl = kl_penalty(logp, data["ref_logp"][idx, :width], alg.kl_loss_type)
                    kl_loss = agg_loss(kl, mask, alg.loss_agg_mode, global_tokens, global_seqs)
                    loss = loss + alg.kl_loss_coef * kl_loss
                    acc.add("actor/kl_loss", kl_loss.detach())
                acc.add("actor/pg_loss", pg_loss.detach())
                acc.add("actor/entropy*", masked_mean(entropy.detach(), mask) * n_tok)
                acc.add("actor/pg_clipfrac*", m["clipfrac"] * n_tok)
                acc.add("actor/pg_clipfrac_lower*", m["clipfrac_lower"] * n_tok)
                acc.add("actor/ppo_kl*", m["approx_kl"] * n_tok)
            acc.add(f"{prefix}/tokens", n_tok)
            loss.backward()
        self._allreduce_grads(params)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, opt.grad_clip)
        if torch.isfinite(grad_norm):
            optim.step()
        else:
            acc.add(f"{prefix}/skipped_steps", 1.0 / self.world_size)
            if not critic:
                self.skipped_steps += 1
        optim.zero_grad(set_to_none=True)
        if self.rank == 0:  # identical on every rank; count it once in the reduced sums
            acc.add(f"{prefix}/grad_norm", grad_norm.detach())
            acc.add(f"{prefix}/updates", 1.0)

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
        sums: dict[str, float],
        data: dict[str, Any],
        scores: torch.Tensor,
        token_rewards: torch.Tensor,
        maskf: torch.Tensor,
        batch: Any,
        ref_logp: torch.Tensor | None,
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for prefix in ("actor", "critic"):
            updates = sums.get(f"{prefix}/updates", 0.0)
            tokens = sums.get(f"{prefix}/tokens", 0.0)
            if updates == 0:
                continue
            for key, value in sums.items():
                if not key.startswith(prefix + "/") or key in (f"{prefix}/updates", f"{prefix}/tokens"):
                    continue
                if key.endswith("*"):
                    out[key[:-1]] = value / max(tokens, 1.0)
                elif key.endswith("skipped_steps"):
                    out[key] = round(value)
                else:
                    out[key] = value / updates
            out.setdefault(f"{prefix}/skipped_steps", 0)
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
        stats("critic/advantages", data["advantages"])
        stats("critic/returns", data["returns"])
        if data["values"] is not None:
            values, returns = data["values"], data["returns"]
            stats("critic/values", values)
            var_ret = torch.var(returns[mask])
            out["critic/vf_explained_var"] = float(
                1.0 - torch.var((returns - values)[mask]) / (var_ret + 1e-5)
            )
        out["rollout/old_log_prob"] = float(masked_mean(data["old_logp"], maskf))
        if ref_logp is not None:
            out["rollout/ref_log_prob"] = float(masked_mean(ref_logp, maskf))
        if self.cfg.algorithm.use_kl_in_reward:
            # use_kl_in_reward implies use_ref: ref_logp is set
            kl = kl_penalty(
                data["old_logp"], cast(torch.Tensor, ref_logp), self.cfg.algorithm.kl_in_reward_type
            )
            out["actor/reward_kl_penalty"] = float(masked_mean(kl, maskf))
            out["actor/reward_kl_penalty_coeff"] = self.cfg.algorithm.kl_coef
        rollout_logp = getattr(batch, "rollout_logprobs", None)
        if rollout_logp is not None:
            rl = rollout_logp[:, : maskf.shape[1]].to(maskf.device, maskf.dtype)
            if bool((rl[mask] != 0).any()):
                out["rollout/old_vs_rollout_logprob_diff"] = float(
                    masked_mean((data["old_logp"] - rl).abs(), maskf)
                )
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

    def _signature(self) -> dict[str, Any]:
        """What must match for a checkpoint to fit: architecture, config hash, parameter shapes."""
        config = getattr(self.policy, "config", None)
        cfg_dict = config.to_dict() if config is not None else {}
        for volatile in (
            "_name_or_path",
            "transformers_version",
            "torch_dtype",
            "dtype",
            "architectures",
            "_commit_hash",
            "use_cache",
        ):
            cfg_dict.pop(volatile, None)
        cfg_json = json.dumps(cfg_dict, sort_keys=True, default=str)

        def shapes(module: nn.Module | None) -> str:
            if module is None:
                return ""
            text = ";".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sorted(module.state_dict().items()))
            return hashlib.sha256(text.encode()).hexdigest()

        base = cast("PeftModel", self.policy).get_base_model() if self.lora else self.policy
        return {
            "architecture": type(base).__name__,
            "model_type": cfg_dict.get("model_type"),
            "config_sha256": hashlib.sha256(cfg_json.encode()).hexdigest(),
            "policy_shapes_sha256": shapes(self.policy),
            "critic": None if self.critic is None else self.cfg.optim.critic,
            "critic_shapes_sha256": shapes(self.critic),
            "lora": self.cfg.lora.model_dump() if self.lora else None,
        }

    def save_checkpoint(
        self, path: str | os.PathLike[str], iteration: int, extra: dict[str, Any] | None = None
    ) -> Path:
        """Write everything needed to resume into ``path`` atomically (temp dir, then rename).

        Layout: ``policy/`` (Hugging Face ``save_pretrained``, safetensors; the adapter with LoRA),
        ``critic.safetensors``, ``optim.pt`` (optimisers, schedulers, counters), ``rng.pt`` (torch,
        CUDA, numpy and Python RNG states), ``manifest.json`` (format, iteration, model signature,
        learner config, ``extra``, the sha256 of every other file under ``files`` and its own under
        ``manifest_sha256``). An existing ``path`` is replaced only once the new one is complete.
        An ``OSError`` (full disk) is raised as ``StorageWriteError`` naming the checkpoint.
        """
        path = Path(path)
        tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
        old = path.parent / f"{path.name}.old-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            cast("PreTrainedModel | PeftModel", self.policy).save_pretrained(
                str(tmp / "policy"), safe_serialization=True
            )
            if self.critic is not None:
                safetensors.torch.save_model(self.critic, str(tmp / "critic.safetensors"))
            optim_state = {
                "actor_optim": self.actor_optim.state_dict(),
                "actor_sched": self.actor_sched.state_dict(),
                "critic_optim": None if self.critic_optim is None else self.critic_optim.state_dict(),
                "critic_sched": None if self.critic_sched is None else self.critic_sched.state_dict(),
                "global_step": self.global_step,
                "skipped_steps": self.skipped_steps,
            }
            torch.save(optim_state, tmp / "optim.pt")
            torch.save(_rng_state(), tmp / "rng.pt")
            # One hash per written file, before the manifest that records them (load checks them all).
            files = {
                p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()
            }
            manifest = {
                "format": CHECKPOINT_FORMAT,
                "iteration": int(iteration),
                "global_step": self.global_step,
                "signature": self._signature(),
                "learner_config": self.cfg.model_dump(mode="json"),
                "extra": extra or {},
                "saved_at": time.time(),
                "files": files,
            }
            manifest = json.loads(json.dumps(manifest, default=str))  # what load_checkpoint will read back
            manifest["manifest_sha256"] = manifest_digest(manifest)
            (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            _fsync_tree(tmp)
            crash_point("checkpoint", int(iteration))
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not path.exists():
                os.replace(old, path)
            os_error = as_os_error(exc, path)
            if os_error is not None:
                raise write_error(path, os_error, "the checkpoint") from exc
            raise
        shutil.rmtree(old, ignore_errors=True)
        return path

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore a ``save_checkpoint`` directory; returns ``{"iteration", "global_step", "extra"}``.

        Everything is read and checked before anything is changed: a file whose sha256 differs from
        the manifest's (checked first, see :func:`verify_checkpoint`), a checkpoint of another model
        (architecture, config or parameter shapes), or a missing / unreadable file raises
        ``CheckpointError`` naming it and leaves this learner as it was.
        """
        path = Path(path)
        manifest = verify_checkpoint(path)
        if manifest.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{path}: checkpoint format {manifest.get('format')}, expected {CHECKPOINT_FORMAT}"
            )
        mine, theirs = self._signature(), manifest.get("signature", {})
        differ = [k for k in mine if mine[k] != theirs.get(k)]
        if differ:
            details = "; ".join(
                f"{k}: checkpoint {theirs.get(k)!r} vs this learner {mine[k]!r}" for k in differ
            )
            raise CheckpointError(
                f"{path}: checkpoint from another model or learner setup ({details}). Load it into a "
                "learner built from the same model (and critic / LoRA settings), or start a new run"
            )
        policy_sd = self._read_policy(path / "policy")
        critic_sd = None
        if self.critic is not None:
            critic_sd = _read_file(
                path / "critic.safetensors", lambda f: safetensors.torch.load_file(str(f)), path
            )
            _check_state(self.critic, critic_sd, path / "critic.safetensors")
        optim_state = _read_file(
            path / "optim.pt", lambda f: torch.load(f, map_location="cpu", weights_only=True), path
        )
        rng = _read_file(
            path / "rng.pt", lambda f: torch.load(f, map_location="cpu", weights_only=True), path
        )
        _check_optim(self.actor_optim, optim_state["actor_optim"], "actor")
        if self.critic_optim is not None:
            _check_optim(self.critic_optim, optim_state["critic_optim"], "critic")

        # Everything is readable and fits: apply.
        with torch.no_grad():
            if self.lora:
                import peft

                peft.set_peft_model_state_dict(self.policy, policy_sd)
            else:
                _load_into(self.policy, policy_sd)
            if self.critic is not None:
                _load_into(self.critic, cast("dict[str, torch.Tensor]", critic_sd))  # read above
        self.actor_optim.load_state_dict(optim_state["actor_optim"])
        self.actor_sched.load_state_dict(optim_state["actor_sched"])
        if self.critic_optim is not None:
            self.critic_optim.load_state_dict(optim_state["critic_optim"])
            # built with critic_optim
            cast(torch.optim.lr_scheduler.LRScheduler, self.critic_sched).load_state_dict(
                optim_state["critic_sched"]
            )
        self.global_step = int(optim_state["global_step"])
        self.skipped_steps = int(optim_state["skipped_steps"])
        _set_rng_state(rng)
        return {
            "iteration": manifest["iteration"],
            "global_step": self.global_step,
            "extra": manifest["extra"],
        }

    def _read_policy(self, directory: Path) -> dict[str, torch.Tensor]:
        from ragen_core.models import load_weight_files

        try:
            sd = load_weight_files(directory)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{directory}: no safetensors weights") from exc
        except ValueError as exc:  # models.load_weight_files names the unreadable file
            raise CheckpointError(str(exc)) from exc
        if self.lora:
            import peft

            expected = peft.get_peft_model_state_dict(self.policy)
            if set(expected) != set(sd) or any(expected[k].shape != sd[k].shape for k in sd):
                raise CheckpointError(f"{directory}: LoRA adapter does not match this learner's adapter")
            return sd
        _check_state(self.policy, sd, directory)
        return sd


# --------------------------------------------------------------------------------------------------
# Checkpoint helpers
# --------------------------------------------------------------------------------------------------


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's content without its own digest (canonical JSON)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's manifest, after checking it and every file it lists against their sha256.

    Raises ``CheckpointError`` naming the first missing or damaged file. Checkpoints written before
    digests existed (no ``files`` in the manifest) pass unchecked; reading them still names a file
    that cannot be read.
    """
    path = Path(path)
    manifest_file = path / _MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{path}: not a learner checkpoint (no {_MANIFEST})")
    fix = f"Nothing was loaded. {_checkpoint_repair(path)}"
    try:
        manifest = json.loads(manifest_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_file}: corrupt manifest: {exc}. {fix}") from exc
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_file}: corrupt manifest: not a JSON object. {fix}")
    which = f"the checkpoint of iteration {manifest.get('iteration')}"
    if "manifest_sha256" in manifest and manifest["manifest_sha256"] != manifest_digest(manifest):
        raise CheckpointError(
            f"{manifest_file}: corrupt manifest: its content does not match its own "
            f"manifest_sha256, so {which} cannot be trusted. {fix}"
        )
    for rel, expected in (manifest.get("files") or {}).items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(
                f"{f}: missing, although {manifest_file} lists it: {which} is incomplete. {fix}"
            )
        actual = sha256_file(f)
        if actual != expected:
            raise CheckpointError(
                f"{f}: corrupt file: its sha256 {actual[:12]}... differs from {expected[:12]}... recorded in "
                f"{manifest_file} when {which} was written. {fix}"
            )
    return manifest


def _checkpoint_repair(path: Path) -> str:
    """The fix for a damaged checkpoint. An iteration's checkpoint in a run directory
    (``<run>/iter_K/checkpoint``) is recomputed by resuming from before iteration K: its learn stage
    sees its damaged output and runs again from checkpoint K - 1 (deterministically on CPU)."""
    folder = path.parent.name
    if path.name == "checkpoint" and folder.startswith("iter_") and folder[5:].isdigit():
        return (
            f"Restore it from a copy, or delete {path.parent / 'DONE'} and resume the run "
            f"(`ragen train --resume`): iteration {int(folder[5:])} is recomputed from its intact inputs"
        )
    return f"Restore {path} from a copy, or start a new run"


def _read_file(f: Path, read: Callable[[Path], _T], checkpoint: Path) -> _T:
    """``read(f)``, with any failure raised as ``CheckpointError`` naming ``f``."""
    try:
        return read(f)
    except Exception as exc:
        raise CheckpointError(
            f"{f}: cannot read this checkpoint file (truncated or corrupt?): "
            f"{type(exc).__name__}: {exc}. Nothing was loaded. {_checkpoint_repair(checkpoint)}"
        ) from exc


def _tied_groups(module: nn.Module) -> dict[str, list[str]]:
    """Map every state-dict key to all keys that share its tensor (tied weights), itself included."""
    by_ptr: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        by_ptr.setdefault((value.data_ptr(), tuple(value.shape)), []).append(key)
    return {key: keys for keys in by_ptr.values() for key in keys}


def _check_state(module: nn.Module, sd: dict[str, torch.Tensor], where: Path) -> None:
    own = module.state_dict()
    groups = _tied_groups(module)
    missing = [k for k in own if not any(alias in sd for alias in groups[k])]
    unexpected = [k for k in sd if k not in own]
    wrong = [k for k in sd if k in own and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{where}: weights do not fit this model (missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {wrong[:5]}); it comes from another model"
        )


def _load_into(module: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy ``sd`` into the module's tensors in place (a tied tensor from whichever name was saved)."""
    groups = _tied_groups(module)
    for key, target in module.state_dict(keep_vars=True).items():
        source = next((sd[alias] for alias in groups[key] if alias in sd), None)
        if source is not None:
            target.data.copy_(source.to(target.device))


def _check_optim(optim: torch.optim.Optimizer, state: dict[str, Any] | None, name: str) -> None:
    if state is None:
        raise CheckpointError(f"checkpoint has no {name} optimiser state")
    groups = state.get("param_groups", [])
    if len(groups) != len(optim.param_groups) or any(
        len(g["params"]) != len(own["params"]) for g, own in zip(groups, optim.param_groups, strict=False)
    ):
        raise CheckpointError(f"{name} optimiser state does not fit this learner's parameters")
    params = [p for g in optim.param_groups for p in g["params"]]
    for idx, st in state.get("state", {}).items():
        avg = st.get("exp_avg")
        if avg is not None and tuple(avg.shape) != tuple(params[int(idx)].shape):
            raise CheckpointError(f"{name} optimiser state has a wrong shape for parameter {idx}")


def _rng_state() -> dict[str, Any]:
    # numpy's stub picks the dict overload for the default legacy=True, which returns this tuple
    np_state = cast("tuple[str, NDArray[np.uint32], int, int, float]", np.random.get_state())
    py_state = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {
            "version": py_state[0],
            "state": torch.tensor(py_state[1], dtype=torch.int64),
            "gauss": py_state[2],
        },
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (helper for tests and scripts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
