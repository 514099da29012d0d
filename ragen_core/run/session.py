"""A training session: the rollout worker and the learner(s) of one run, in-process or as Ray actors,
kept alive across iterations; it knows which iteration's state they hold."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ragen_core.config import RagenConfig
from ragen_core.run.run_dir import RunDir, atomic_write_text

if TYPE_CHECKING:  # the learner and the rollout worker load torch and Ray: imported when a session starts
    from ragen_core.learner.actors import ActorMethods, LearnerGroup, LearnerWorker
    from ragen_core.rollout.worker import RolloutWorker


class Session:
    """The live parts of a run: a rollout worker and a learner (group), kept across iterations.

    ``backend="ray"`` runs them as Ray actors (resources from the config); ``"local"`` keeps them
    in this process (tests, debugging, the overhead baseline). Weights go from the learner to the
    rollout worker after every learner step; ``learner_at`` and ``worker_at`` record which iteration's
    state each holds.
    """

    def __init__(self, cfg: RagenConfig, run: RunDir, backend: str = "ray") -> None:
        from ragen_core.learner import ray_sessions
        from ragen_core.learner.actors import LearnerWorker, init_ray
        from ragen_core.rollout.worker import RolloutWorker
        from ragen_core.run.service_watch import watch_services

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
        self._worker_args = worker_args
        #: in-process parts (backend "local"), or the rollout actor's handle and the learner group ("ray")
        self.worker: RolloutWorker | ActorMethods
        self.learner: LearnerWorker | LearnerGroup
        if backend == "ray":
            import ray

            init_ray()
            # a cluster started here ends the run with a line when its raylet or GCS dies (a normal
            # ray.shutdown() stops them too, after ray.is_initialized() turns false)
            watch_services(ray_sessions.cluster_services(), still_needed=ray.is_initialized)
            self._start_actors(cfg.trainer.learners)
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

    def _start_actors(self, learners: int, placement_timeout_s: float = 30.0) -> None:
        """The rollout actor, then the learner group (its placement group reserved at once or not at all)."""
        from ragen_core.learner.actors import LearnerGroup, kill_actor
        from ragen_core.rollout.worker import RolloutActor

        t = self.cfg.trainer
        # its methods are called by name (call_worker), all but close
        worker = cast(
            "ActorMethods",
            RolloutActor.options(num_cpus=t.rollout_cpus, num_gpus=t.rollout_gpus).remote(*self._worker_args),
        )
        self.worker = worker
        try:
            self.learner = LearnerGroup(
                self.cfg.learner,
                str(self.run.init_policy),
                world_size=learners,
                placement_timeout_s=placement_timeout_s,
            )
        except BaseException:
            kill_actor(worker)
            raise
        self.learners = learners

    def rebuild(self, placement_timeout_s: float = 10.0) -> int:
        """After a Ray actor or node was lost: a new rollout actor and learner group on the cluster as
        it is now, with as many learners as it can hold (``trainer.learners`` at most; a checkpoint
        resumes with any count, and each learn stage records its own). Both parts hold no iteration's
        state until the next restore loads it from disk. Returns the learner count."""
        from ragen_core.learner.actors import LearnerPlacementError

        if self.backend != "ray":
            raise RuntimeError("only the ray backend's actors can be rebuilt")
        with contextlib.suppress(Exception):  # what is left of the old actors
            self.close()
        for learners in range(self.cfg.trainer.learners, 0, -1):
            try:
                self._start_actors(learners, placement_timeout_s)
                break
            except LearnerPlacementError:
                if learners == 1:
                    raise
        self.learner_at = self.worker_at = -1  # unknown: the next restore loads from disk
        return self.learners

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
        from ragen_core.learner.actors import LearnerWorker, kill_actor
        from ragen_core.rollout.worker import RolloutWorker

        # the backend decided the types: in-process parts ("local") or Ray actors ("ray")
        if isinstance(self.learner, LearnerWorker):
            self.learner.close()
        else:
            self.learner.shutdown()
        if isinstance(self.worker, RolloutWorker):
            self.worker.close()
        else:
            import ray

            with contextlib.suppress(Exception):  # stops a vLLM child; a dead actor has none left
                ray.get(self.worker.close.remote(), timeout=60)
            kill_actor(self.worker)


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
