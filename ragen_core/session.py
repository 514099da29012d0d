"""A training session: the rollout worker and the learner(s) of one run, in-process or as Ray actors,
kept alive across iterations; it knows which iteration's state they hold."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragen_core.config import RagenConfig
from ragen_core.run_dir import RunDir, atomic_write_text


class Session:
    """The live parts of a run: a rollout worker and a learner (group), kept across iterations.

    ``backend="ray"`` runs them as Ray actors (resources from the config); ``"local"`` keeps them
    in this process (tests, debugging, the overhead baseline). Weights go from the learner to the
    rollout worker after every learner step; ``learner_at`` and ``worker_at`` record which iteration's
    state each holds.
    """

    def __init__(self, cfg: RagenConfig, run: RunDir, backend: str = "ray") -> None:
        from ragen_core.actors import LearnerGroup, LearnerWorker, init_ray
        from ragen_core.rollout.worker import RolloutActor, RolloutWorker

        self.cfg, self.run, self.backend = cfg, run, backend
        #: data-parallel learner ranks (the in-process backend has one learner, whatever the config)
        self.learners = cfg.trainer.learners if backend == "ray" else 1
        worker_args = (
            str(run.init_policy),
            cfg.agent.model_dump(),
            cfg.train.model_dump(),
            cfg.val.model_dump(),
            cfg.rollout.engine,
            cfg.rollout.max_batch_size,
            cfg.rollout.max_model_len,
            cfg.trainer.rollout_threads,
            engine_options(cfg),
            rollout_dtype(cfg),
        )
        if backend == "ray":
            init_ray()
            self.worker = RolloutActor.options(
                num_cpus=cfg.trainer.rollout_cpus, num_gpus=cfg.trainer.rollout_gpus
            ).remote(*worker_args)
            self.learner: Any = LearnerGroup(
                cfg.learner, str(run.init_policy), world_size=cfg.trainer.learners
            )
        elif backend == "local":
            self.worker = RolloutWorker(*worker_args)
            self.learner = LearnerWorker(cfg.learner, str(run.init_policy))
            self.learner.build()
        else:
            raise ValueError(f"unknown backend {backend!r}; use 'ray' or 'local'")
        #: which iteration's state the learner and the rollout worker hold (they differ while a
        #: one-step off-policy rollout is played: ``trainer.off_policy_steps``)
        self.learner_at = self.worker_at = 0
        if not (run.checkpoint(0) / "manifest.json").exists():  # so that restore(0) can undo steps
            self.learner.save_checkpoint(str(run.checkpoint(0)), 0)

    def call_worker(self, method: str, *args: Any) -> Any:
        if self.backend == "ray":
            import ray

            return ray.get(getattr(self.worker, method).remote(*args))
        return getattr(self.worker, method)(*args)

    def sync_weights(self) -> None:
        weights = self.learner.get_weights()
        self.call_worker("update_weights", weights)

    @property
    def parallel_actors(self) -> bool:
        """Whether the rollout worker and the learner compute at the same time when both are called
        (Ray actors, each in its own process), rather than one after the other in this process."""
        return self.backend == "ray"

    @property
    def at(self) -> int:
        """The iteration whose state both parts hold (-1 while they differ)."""
        return self.learner_at if self.learner_at == self.worker_at else -1

    def advance(self, k: int, sync_worker: bool = True) -> None:
        """After the learner stepped to iteration ``k``: the rollout worker gets its weights, unless
        ``sync_worker`` is false (one-step off-policy: the worker may be playing with older weights
        at this moment; it loads the ones it needs from disk, :meth:`worker_to`)."""
        self.learner_at = k
        if sync_worker:
            self.sync_weights()
            self.worker_at = k

    def learner_to(self, k: int) -> None:
        """Put the learner at the state after iteration ``k`` (weights and optimiser, from its checkpoint)."""
        if k != self.learner_at:
            self.learner.load_checkpoint(str(self.run.checkpoint(k)))
            self.learner_at = k

    def worker_to(self, k: int) -> None:
        """Put the rollout worker at the policy after iteration ``k`` (from its checkpoint)."""
        if k != self.worker_at:
            self.call_worker("load_weights_from", str(self.run.policy_after(k)))
            self.worker_at = k

    def restore(self, k: int) -> None:
        """Put the learner and the rollout worker at the state after iteration ``k``."""
        self.learner_to(k)
        self.worker_to(k)

    def roll_back(self, k: int, to: int, signals: Sequence[str]) -> Path:
        """After iteration ``k``, continue from the state after iteration ``to`` (an Echo-Trap
        rollback). Recorded in ``rollbacks/after_<k>.json``, which :meth:`RunDir.start_of` reads;
        iteration ``k``'s own checkpoint stays as it was trained."""
        if not 0 <= to < k:
            raise ValueError(f"a rollback after iteration {k} must go back to an earlier one, not {to}")
        self.restore(to)
        path = self.run.rollback_file(k)
        atomic_write_text(
            path, json.dumps({"after": k, "to": to, "signals": list(signals), "at": time.time()}, indent=1)
        )
        return path

    def close(self) -> None:
        if self.backend == "ray":
            import ray

            self.learner.shutdown()
            with contextlib.suppress(Exception):  # stops a vLLM child; a dead actor has none left
                ray.get(self.worker.close.remote(), timeout=60)
            ray.kill(self.worker)
        else:
            self.learner.close()
            self.worker.close()


def rollout_dtype(cfg: RagenConfig) -> str:
    """The dtype the rollout engine holds the weights in: ``rollout.dtype``, else ``model.dtype``."""
    return cfg.rollout.dtype or cfg.model.dtype


def engine_options(cfg: RagenConfig) -> dict[str, Any]:
    """The vLLM engine's settings from a config (unused by the ``hf`` engine)."""
    return {
        "dtype": rollout_dtype(cfg),
        "gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
        "enforce_eager": cfg.rollout.enforce_eager,
        "tensor_parallel_size": cfg.rollout.tensor_parallel_size,
        "seed": cfg.trainer.seed,
    }
