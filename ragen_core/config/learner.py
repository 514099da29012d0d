"""The learner's config: advantage estimator and losses, optimisers and batching, LoRA.

``LearnerConfig`` is the ``learner`` section of a run's config (``ragen_core.config``). It lives apart
from the learner so that reading or checking a config needs no model code; its defaults are RAGEN's
``base.yaml`` (else veRL's), see docs/architecture.md, "Learner step".
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ragen_core.algorithm_modes import AGG_MODES, KL_KINDS
from ragen_core.algorithms.registry import ADV_ESTIMATORS, POLICY_LOSSES

__all__ = ["AlgorithmConfig", "LearnerConfig", "LoraConfig", "OptimConfig", "RewardNormalizationConfig"]


class RewardNormalizationConfig(BaseModel):
    """RAGEN-2's reward normalisation: trajectory scores rescaled within groups before the advantages
    (``ragen_core.algorithms.normalize_scores``; docs/architecture.md, "Learner step")."""

    model_config = ConfigDict(extra="forbid")

    grouping: Literal["state", "batch", "inductive"] = Field(
        default="state",
        description="which trajectories share statistics: state (one initial state, the rollout group), "
        "inductive (one environment tag), batch (the learner's whole batch)",
    )
    method: Literal["identity", "mean", "mean_std", "asym_clip"] = Field(
        default="identity",
        description="identity (scores as they are), mean (minus the group mean), mean_std (minus the mean, "
        "over the std; 0 for a group without spread), asym_clip (mean_std clamped to [-1, 3])",
    )

    @property
    def active(self) -> bool:
        return self.method != "identity"


class AlgorithmConfig(BaseModel):
    """Advantage estimator, losses and KL terms (defaults of RAGEN's base.yaml; docs/architecture.md,
    "Learner step")."""

    model_config = ConfigDict(extra="forbid")

    adv_estimator: str = Field(
        default="gae",
        description="a registered advantage estimator (ragen_core.algorithms.registry): gae (PPO with a "
        "critic), grpo (group-normalised score), rloo (leave-one-out baseline), reinforce_pp (REINFORCE++: "
        "whitened discounted returns, no critic), or one a plug-in registered",
    )
    policy_loss: str = Field(
        default="vanilla",
        description="a registered policy loss (ragen_core.algorithms.registry; veRL's policy_loss.loss_mode): "
        "vanilla (PPO's clipped surrogate with clip-higher and dual clip), or one a plug-in registered",
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
    reward_normalization: RewardNormalizationConfig = Field(
        default_factory=RewardNormalizationConfig,
        description="RAGEN-2's reward normalisation of the trajectory scores (off: method identity)",
    )
    use_turn_scores: bool = Field(
        default=False,
        description="reward each trained turn on its last token (its env reward + format penalty) instead of "
        "the trajectory score on the last token; GRPO / RLOO then use the sum of the trained turns' scores. "
        "bi_level_gae always reads the turn scores",
    )
    soft_advantage_reweight: bool = Field(
        default=False,
        description="GRPO: scale each group's advantages by its score std over the largest group std, "
        "down-weighting low-variance groups instead of filtering them",
    )
    grpo_advantage_length_weight: bool = Field(
        default=False,
        description="GRPO: divide each trajectory's advantages by its trained-token count over the batch mean",
    )
    zero_task_advantage: bool = Field(
        default=False,
        description="ablation: set every advantage to 0, so only the entropy and KL terms move the policy "
        "(the critic still trains)",
    )

    @field_validator("adv_estimator")
    @classmethod
    def _estimator(cls, v: str) -> str:
        if v not in ADV_ESTIMATORS:
            raise ValueError(ADV_ESTIMATORS.unknown(v))
        return v

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss(cls, v: str) -> str:
        if v not in POLICY_LOSSES:
            raise ValueError(POLICY_LOSSES.unknown(v))
        return v

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
        for key in ("soft_advantage_reweight", "grpo_advantage_length_weight"):
            if getattr(self, key) and self.adv_estimator != "grpo":
                raise ValueError(
                    f"algorithm.{key}=true needs algorithm.adv_estimator=grpo (got {self.adv_estimator!r}); "
                    f"set adv_estimator grpo or {key} false"
                )
        norm = self.reward_normalization
        if norm.active and self.use_turn_scores:
            raise ValueError(
                f"algorithm.reward_normalization.method={norm.method!r} normalises trajectory scores, but "
                "algorithm.use_turn_scores=true rewards each turn instead (RAGEN-2 skips the normalisation "
                "then); set reward_normalization.method identity or use_turn_scores false"
            )
        if norm.active and self.bi_level_gae:
            raise ValueError(
                f"algorithm.reward_normalization.method={norm.method!r} normalises trajectory scores, but "
                "algorithm.bi_level_gae=true reads each turn's own score; set reward_normalization.method "
                "identity or bi_level_gae false"
            )
        return self

    @property
    def use_critic(self) -> bool:
        """The estimator reads a critic's values (registered with ``critic=True``)."""
        return ADV_ESTIMATORS[self.adv_estimator].critic

    @property
    def group_baseline(self) -> bool:
        """The estimator's baseline is the trajectory's group (registered with ``group_baseline=True``)."""
        return ADV_ESTIMATORS[self.adv_estimator].group_baseline

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
    placement: Literal["pack", "spread"] = Field(
        default="pack",
        description="how the learner ranks' placement group lies over the Ray nodes: pack (as few nodes as "
        "possible: the all-reduce stays on one node when it can) or spread (one rank per node as far as the "
        "nodes allow: a node's loss takes fewer ranks, each rank gets a node's memory bandwidth)",
    )
    bf16_autocast_on_gpu: bool = Field(
        default=True, description="bf16 autocast for forward passes on GPU (weights stay fp32)"
    )
    bf16_autocast_on_cpu: bool = Field(
        default=False,
        description="bf16 autocast for forward passes on CPU (weights stay fp32): faster on CPUs with "
        "AVX512-BF16 or AMX, emulated and slower elsewhere (benchmarks/bf16.py measures both)",
    )
    shared_prefix: bool = Field(
        default=False,
        description="run the tokens every row of a micro-batch starts with (system prompt, instruction) once "
        "and reuse their key/value cache in the policy's forward passes: the same log-probs and gradients up "
        "to float rounding, faster on long shared prompts (Qwen2/Qwen3/Llama/Mistral; others ignore it). Off "
        "by default so that stored runs of existing configs rerun bit for bit",
    )
    seed: int = Field(default=0, description="seeds the critic head's initialisation and the shuffle")
