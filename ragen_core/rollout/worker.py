"""The rollout worker: a policy's engine and its env groups, kept alive across iterations.

``RolloutWorker`` runs in-process; ``RolloutActor`` is the same class as a Ray actor. Either way it
is built once per training run, receives new weights after every learner step
(``update_weights``), and plays a whole split (train groups for iteration k, or the fixed
validation groups) per call, returning the trajectories as an Arrow table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import ray
import torch

from ragen_core.env_groups import EnvGroups, EnvGroupsConfig, Mode
from ragen_core.progress import PROGRESS_ENV, show_progress_lines
from ragen_core.protocol import ProtocolConfig
from ragen_core.rollout.engine import RolloutEngine, SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import run_rollouts
from ragen_core.trajectory import to_table

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class RolloutWorker:
    """Engine + tokenizer + train/val env groups. Arguments are plain data so Ray can ship them."""

    def __init__(
        self,
        policy_path: str,
        protocol: Mapping[str, Any],
        train: Mapping[str, Any],
        val: Mapping[str, Any],
        engine: str = "hf",
        max_batch_size: int | None = None,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        engine_options: Mapping[str, Any] | None = None,
        dtype: str = "float32",
    ) -> None:
        from ragen_core.models.policies import load_policy

        if os.environ.get(PROGRESS_ENV) == "1":
            show_progress_lines()
        if num_threads:
            torch.set_num_threads(num_threads)
        self.policy_path, self.dtype = policy_path, dtype
        self.model: PreTrainedModel | None
        if engine == "hf":
            self.model, self.tokenizer = load_policy(policy_path, dtype=dtype)
            self.engine: RolloutEngine = HFEngine(
                self.model, self.tokenizer, max_batch_size=max_batch_size, max_model_len=max_model_len
            )
        elif engine == "vllm":
            # vLLM holds the weights in its own process: only the tokenizer is loaded here
            from ragen_core.models.policies import load_tokenizer
            from ragen_core.rollout.vllm_engine import engine_from_policy

            self.model = None
            self.tokenizer = load_tokenizer(policy_path)
            self.engine = engine_from_policy(
                policy_path, self.tokenizer, max_model_len=max_model_len, **dict(engine_options or {})
            )
        else:
            raise ValueError(f"rollout.engine={engine!r} is not a rollout backend; use 'hf' or 'vllm'")
        self.groups: dict[str, EnvGroups] = {}
        self.set_groups("train", protocol, train)
        self.set_groups("val", protocol, val)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.engine.update_weights(state_dict)

    def load_weights_from(self, policy_path: str) -> None:
        """Load a saved policy's weights (used when a stage is rerun or a run resumes).

        ``policy_path`` holds full weights (``model.safetensors``) or a LoRA adapter, which is merged
        into this worker's base weights.
        """
        from pathlib import Path

        path = Path(policy_path)
        if (path / "adapter_config.json").exists():
            from peft import PeftModel

            from ragen_core.models.policies import load_policy

            base, _ = load_policy(self.policy_path, dtype=self.dtype)
            merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
            self.engine.update_weights(merged.state_dict())
            return
        from ragen_core.models.policies import load_weight_files

        self.engine.update_weights(load_weight_files(path))

    def set_groups(self, split: Mode, protocol: Mapping[str, Any], groups: Mapping[str, Any]) -> None:
        """Play ``split`` with other env groups from now on (``ragen evaluate`` plays tags whose turn
        budgets differ one after another, on one loaded model)."""
        if split in self.groups:
            self.groups[split].close()
        self.groups[split] = EnvGroups(
            EnvGroupsConfig.model_validate(dict(groups)),
            ProtocolConfig.model_validate(dict(protocol)),
            mode=split,
        )

    def rollout(
        self,
        split: str,
        seed_round: int,
        iteration: int,
        params: Mapping[str, Any],
        seed: int,
        run_id: str = "",
    ) -> tuple[pa.Table, dict[str, float]]:
        """Play one episode per env of ``split`` (seeds of ``seed_round``, rows labelled
        ``iteration``: see ``run_rollouts``); returns (trajectory table, env metrics)."""
        groups = self.groups[split]
        trajs = run_rollouts(
            groups,
            self.engine,
            self.tokenizer,
            SamplingParams(**params),
            seed=seed,
            seed_round=seed_round,
            iteration=iteration,
            run_id=run_id,
        )
        return to_table(trajs), groups.metrics()

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        """Stop the engine (the vLLM child process, if any) and close the envs (a remote one's session)."""
        for groups in self.groups.values():
            groups.close()
        self.engine.close()


RolloutActor = ray.remote(RolloutWorker)
