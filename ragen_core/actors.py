"""Ray actors for the learner: one ``LearnerActor`` per process, K of them form a data-parallel group.

``LearnerGroup(cfg, model_factory, world_size=K)`` starts K ``LearnerActor`` s (each with
``cfg.num_cpus`` CPUs and ``cfg.num_gpus`` GPUs), joins them into a ``torch.distributed`` process
group (gloo on CPU, NCCL on GPU; rendezvous through a TCP store on rank 0's node at a free port
that rank 0 picks), and builds one ``Learner`` in each. ``step(batch)`` sends the whole batch to
every actor through the object store once; each learner trains on its contiguous share of every
mini-batch, with the mini-batch's global token counts and all-reduced gradients, so K learners take
exactly the optimiser step one learner would take (see ``ragen_core.learner``). The metrics of
rank 0 are returned; they are global (reduced over the group).

``init_ray()`` connects to ``RAY_ADDRESS`` when it is set, else starts a small local cluster
(capped object store, no dashboard, no usage stats, no auth token file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from ragen_core.learner import Learner, LearnerConfig

__all__ = ["LearnerActor", "LearnerGroup", "LearnerWorker", "init_ray"]

#: Environment of the driver and of every Ray worker.
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}

ModelFactory = Callable[[], torch.nn.Module] | str | os.PathLike


def init_ray(
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    object_store_memory: int = 512 * 1024**2,
    address: str | None = None,
    env_vars: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start or join Ray once per process; returns ``ray.cluster_resources()``.

    ``address`` (default ``$RAY_ADDRESS``) joins an existing cluster. Otherwise a local cluster with
    ``num_cpus`` (default ``$RAGEN_RAY_NUM_CPUS`` or the machine's CPU count) and an object store
    capped at ``object_store_memory`` bytes is started. Workers get ``RAY_ENV`` (+ ``env_vars``) as
    environment variables; the project is importable there because it is installed in the venv.
    """
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if not ray.is_initialized():
        runtime_env = {"env_vars": {**RAY_ENV, **(env_vars or {})}}
        address = address or os.environ.get("RAY_ADDRESS") or None
        common = {"runtime_env": runtime_env, "logging_level": logging.WARNING, "log_to_driver": True}
        if address:
            ray.init(address=address, **common)
        else:
            if num_cpus is None:
                num_cpus = int(os.environ.get("RAGEN_RAY_NUM_CPUS", os.cpu_count() or 1))
            ray.init(
                num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_memory,
                include_dashboard=False, **common,
            )
    return ray.cluster_resources()


def _get_all(refs: list[Any]) -> list[Any]:
    """``ray.get`` of every ref; on failure the others are still collected (no "unhandled error" noise)."""
    try:
        return ray.get(refs)
    except BaseException:
        for ref in refs:
            with contextlib.suppress(BaseException):
                ray.get(ref, timeout=60)
        raise


def _build_model(factory: ModelFactory) -> torch.nn.Module:
    if callable(factory):
        return factory()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(factory), dtype=torch.float32)


class LearnerWorker:
    """The body of a ``LearnerActor`` (usable in-process too): one rank of the learner group."""

    def __init__(self, cfg: dict[str, Any] | LearnerConfig, model_factory: ModelFactory, rank: int = 0,
                 world_size: int = 1) -> None:
        self.cfg = LearnerConfig.model_validate(cfg) if isinstance(cfg, dict) else cfg
        self.model_factory = model_factory
        self.rank, self.world_size = rank, world_size
        self.learner: Learner | None = None

    # -- set-up, called by LearnerGroup in this order
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free TCP port on it (called on rank 0)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        try:
            host = ray.util.get_node_ip_address()
        except Exception:  # not inside Ray
            host = "127.0.0.1"
        return host, port

    def init_process_group(self, host: str, port: int, backend: str, timeout_s: float = 300.0) -> None:
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def build(self) -> int:
        """Build the model and the learner (after the process group: rank 0's weights are broadcast)."""
        device = "cuda" if self.cfg.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        if device == "cuda" and dist.is_initialized():
            torch.cuda.set_device(0)  # Ray gives each actor its own CUDA_VISIBLE_DEVICES
        self.learner = Learner(_build_model(self.model_factory), self.cfg, device=device)
        return sum(p.numel() for p in self.learner.policy.parameters())

    # -- work
    def step(self, batch: Any, turn_scores: torch.Tensor | None = None) -> dict[str, float]:
        assert self.learner is not None
        return self.learner.step(batch, turn_scores)

    def get_weights(self) -> dict[str, torch.Tensor]:
        assert self.learner is not None
        return self.learner.policy_state_dict()

    def save_checkpoint(self, path: str, iteration: int, extra: dict[str, Any] | None = None) -> str | None:
        assert self.learner is not None
        out = None
        if self.rank == 0:  # every rank holds the same weights and optimiser state
            out = str(self.learner.save_checkpoint(path, iteration, extra))
        if dist.is_initialized():
            dist.barrier()
        return out

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        assert self.learner is not None
        return self.learner.load_checkpoint(path)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


#: The Ray actor class; resources are set per instance with ``.options`` (see ``LearnerGroup``).
LearnerActor = ray.remote(LearnerWorker)


class LearnerGroup:
    """K learner actors training one policy data-parallel; call it like a single ``Learner``.

    Args:
        cfg: learner config; ``num_cpus`` / ``num_gpus`` are the resources of *each* actor.
        model_factory: a picklable zero-argument callable returning the policy model (e.g.
            ``functools.partial(Qwen2ForCausalLM.from_pretrained, path)``) or a model directory.
            Rank 0's weights are broadcast to the others, so it need not be deterministic.
        world_size: number of learner actors.
        backend: ``torch.distributed`` backend; default gloo on CPU, nccl on GPU.
    """

    def __init__(self, cfg: LearnerConfig, model_factory: ModelFactory, world_size: int = 1,
                 backend: str | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not ray.is_initialized():
            init_ray()
        self.cfg, self.world_size = cfg, world_size
        self.backend = backend or ("nccl" if cfg.num_gpus > 0 else "gloo")
        cfg_dict = cfg.model_dump(mode="json")
        self.actors = [
            LearnerActor.options(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus).remote(
                cfg_dict, model_factory, rank, world_size
            )
            for rank in range(world_size)
        ]
        try:
            if world_size > 1:
                host, port = ray.get(self.actors[0].rendezvous_address.remote())
                _get_all([a.init_process_group.remote(host, port, self.backend) for a in self.actors])
            self.num_params = _get_all([a.build.remote() for a in self.actors])[0]
        except BaseException:
            self.shutdown()
            raise

    def step(self, batch: Any, turn_scores: torch.Tensor | None = None) -> dict[str, float]:
        """One learner step on the whole (filtered) batch; returns rank 0's (global) metrics."""
        ref = ray.put(batch)
        return _get_all([a.step.remote(ref, turn_scores) for a in self.actors])[0]

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (CPU tensors, plain model names; LoRA merged) for rollout actors."""
        return ray.get(self.actors[0].get_weights.remote())

    def save_checkpoint(self, path: str | os.PathLike, iteration: int, extra: dict[str, Any] | None = None) -> Path:
        results = _get_all([a.save_checkpoint.remote(str(path), iteration, extra) for a in self.actors])
        return Path(results[0])

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        return _get_all([a.load_checkpoint.remote(str(path)) for a in self.actors])[0]

    def shutdown(self) -> None:
        """Leave the process group and stop the actors."""
        if not self.actors:
            return
        with contextlib.suppress(Exception):  # the actors are killed below anyway
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def __enter__(self) -> LearnerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
