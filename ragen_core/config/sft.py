"""The ``sft`` section of a run's config: the supervised warm start's demonstrations and training.
Plain pydantic, so the config loads without torch; ``ragen_core.learner.sft`` runs it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Base seed of the demonstration episodes: group ``i`` of a demo batch plays seed ``DEFAULT_DEMO_SEED + i``.
#: Validation uses ``123 + i`` and RL training ``10000 + iteration * P + i``, so for any run with fewer than
#: ~990 000 train initial states the three sets are disjoint.
DEFAULT_DEMO_SEED = 1_000_000


class SFTConfig(BaseModel):
    """The supervised warm start: which demonstrations, how they are written, how long to train."""

    model_config = ConfigDict(extra="forbid")

    # ---------------------------------------------------------------- demonstrations
    tags: list[str] = Field(
        default=["SimpleSokoban"],
        description="Catalogue tags to demonstrate (one warm start may mix several).",
    )
    episodes_per_tag: int = Field(
        default=256, ge=1, description="Demonstration episodes per tag (one distinct initial state each)."
    )
    env_overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="tag -> env_config overrides, as in EnvGroupsConfig."
    )
    demo_seed: int = Field(
        default=DEFAULT_DEMO_SEED,
        description="Base env seed of the demonstrations (episode i of the batch plays demo_seed + i).",
    )
    optimal_fraction: float = Field(
        default=0.7,
        ge=0.0,
        le=1.0,
        description=(
            "Probability that a turn's (noise_unit='turn') or an episode's (noise_unit='episode') actions "
            "come from the oracle; otherwise they are uniformly random actions from the env's vocabulary "
            "(as many as the oracle would have taken; free-text envs: a perturbed answer)."
        ),
    )
    noise_unit: Literal["turn", "episode"] = Field(
        default="turn",
        description=(
            "'turn': the oracle/random choice is drawn per turn, so later oracle turns show recovery from "
            "the states random turns lead to; 'episode': whole episodes are oracle or random."
        ),
    )

    # ---------------------------------------------------------------- optimisation
    steps: int = Field(
        default=300, ge=1, description="Optimizer steps (the demos are cycled, reshuffled each epoch)."
    )
    batch_size: int = Field(default=16, ge=1, description="Sequences per optimizer step.")
    lr: float = Field(
        default=3e-3, gt=0.0, description="Peak AdamW learning rate (1e-3..3e-3 for tiny models)."
    )
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="Final lr / peak lr (cosine decay).")
    warmup_steps: int = Field(default=20, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(default=0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = Field(default=1.0, gt=0.0, description="Max global grad norm.")
    seed: int = Field(default=0, description="Seeds the noise draws and the shuffling.")
    max_seconds: float | None = Field(
        default=None,
        gt=0.0,
        description="Stop training after this many seconds (budget guard); None: no limit.",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads while training (restored afterwards); None: leave as is.",
    )
    log_every: int = Field(default=10, ge=1, description="Loss-curve resolution (steps).")
    shared_prefix: bool = Field(
        default=False,
        description=(
            "Run the tokens every sequence of a batch starts with (system prompt and instruction) once and "
            "reuse their key/value cache: the same loss and gradients up to float rounding, 2-3x faster "
            "on long prompts. Off by default so that stored runs of existing configs retrain bit for bit."
        ),
    )

    @field_validator("tags")
    @classmethod
    def _check_tags(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("tags must name at least one catalogue tag")
        if len(set(v)) != len(v):
            raise ValueError(f"tags must be distinct, got {v}")
        return v

    @model_validator(mode="after")
    def _check_overrides(self) -> SFTConfig:
        unknown = set(self.env_overrides) - set(self.tags)
        if unknown:
            raise ValueError(f"env_overrides for tags not in tags: {sorted(unknown)}")
        return self
