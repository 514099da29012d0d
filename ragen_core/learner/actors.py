"""Ray actors for the learner: one ``LearnerActor`` per process, K of them form a data-parallel group.

``LearnerGroup(cfg, model_factory, world_size=K)`` starts K ``LearnerActor`` s (each with
``cfg.num_cpus`` CPUs and ``cfg.num_gpus`` GPUs), joins them into a ``torch.distributed`` process
group (gloo on CPU, NCCL on GPU; rendezvous through a TCP store on rank 0's node at a free port
that rank 0 picks), and builds one ``Learner`` in each. ``step(batch)`` sends the whole batch to
every actor through the object store once; each learner trains on its contiguous share of every
mini-batch, with the mini-batch's global token counts and all-reduced gradients, so K learners take
exactly the optimiser step one learner would take (see ``ragen_core.learner.update``). The metrics of
rank 0 are returned; they are global (reduced over the group).

The actors of a group are placed through one Ray placement group: every bundle is reserved before
any actor starts, so a group the cluster cannot hold fails at once (``LearnerPlacementError``,
naming ``trainer.learners``, ``learner.num_cpus`` and what the cluster has) instead of one rank
waiting at the rendezvous for a peer that never gets a CPU.

``init_ray()`` connects to ``RAY_ADDRESS`` when it is set. Otherwise it always starts a cluster of
its own (never joins one that another process started on this machine), small (capped object
store, no dashboard, no usage stats), with every Ray process listening on 127.0.0.1 only, and Ray's
token authentication on, the token kept in the state folder (``<state>/ray/auth_token``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, cast

import ray
import torch
import torch.distributed as dist

from ragen_core.config.learner import LearnerConfig
from ragen_core.errors import RagenError, ray_actor_lost
from ragen_core.learner import ray_sessions
from ragen_core.learner.batch import TokenBatch
from ragen_core.learner.update import Learner
from ragen_core.state_folder import state_dir

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

__all__ = [
    "ActorMethods",
    "LearnerActor",
    "LearnerGroup",
    "LearnerHandle",
    "LearnerPlacementError",
    "LearnerWorker",
    "RayAddressError",
    "RemoteMethod",
    "alive_nodes",
    "init_ray",
    "kill_actor",
    "local_cluster_cpus",
    "node_ip_address",
    "ray_address_problem",
    "reserve_learners",
]

#: Environment of the driver and of every Ray worker. (Not RAY_AUTH_MODE: a cluster given by
#: RAY_ADDRESS decides its own; ``init_ray`` turns token auth on for the clusters it starts.)
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # Keep /proc/<pid>/environ of retitled Ray processes readable (flows.settings' watchdog finds a
    # run's processes by an environment marker).
    "SPT_NOENV": "1",
}

ModelFactory = Callable[[], torch.nn.Module] | str | os.PathLike[str]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class RemoteMethod(Protocol[_P, _R]):
    """An actor's method as its caller sees it: ``.remote(...)`` queues the call and returns the
    reference of its result (an argument may be a reference too: Ray passes the object)."""

    def remote(self, *args: _P.args, **kwargs: _P.kwargs) -> ray.ObjectRef[_R]: ...


class ActorMethods(Protocol):
    """A handle of one of this project's actors. Ray types an actor handle's methods as ``Never`` (it
    looks them up at run time), so a handle is cast, where its actor starts, to a protocol that names
    the methods its caller uses; each mirrors its worker class."""

    close: RemoteMethod[[], None]


class LearnerHandle(ActorMethods, Protocol):
    """A ``LearnerActor``: the methods of ``LearnerWorker`` that ``LearnerGroup`` calls."""

    rendezvous_address: RemoteMethod[[], tuple[str, int]]
    init_process_group: RemoteMethod[[str, int, str], None]
    build: RemoteMethod[[], int]
    step: RemoteMethod[
        [TokenBatch | ray.ObjectRef[TokenBatch], torch.Tensor | None, float, bool], dict[str, float]
    ]
    get_weights: RemoteMethod[[], dict[str, torch.Tensor]]
    cross_logprobs: RemoteMethod[[Sequence[Sequence[int]], Sequence[Sequence[int]]], torch.Tensor]
    save_checkpoint: RemoteMethod[[str, int, dict[str, Any] | None], str | None]
    load_checkpoint: RemoteMethod[[str], dict[str, Any]]


def kill_actor(actor: ActorMethods) -> None:
    """``ray.kill`` of a handle typed by one of the protocols above (Ray's own type for it is
    ``ActorHandle``)."""
    ray.kill(cast("ActorHandle[Any]", actor))


def node_ip_address() -> str:
    """This node's address in the Ray cluster (or this machine's, outside one)."""
    address: str = ray.util.get_node_ip_address()
    return address


def alive_nodes() -> list[dict[str, Any]]:
    """The Ray cluster's live nodes as ``ray.nodes()`` describes them (``Resources``, ``NodeManagerAddress``)."""
    nodes: list[dict[str, Any]] = ray.nodes()
    return [n for n in nodes if n.get("Alive")]


class RayAddressError(RagenError, RuntimeError):
    """``RAY_ADDRESS`` names a cluster that does not answer."""


def ray_address_problem(address: str, timeout_s: float = 5.0) -> str | None:
    """Why no Ray cluster answers at ``address`` (``host:port`` or ``ray://host:port``), or None.

    ``ray.init`` itself keeps retrying an address that does not answer for minutes; a TCP connect to
    the cluster's port says at once. ``auto`` and ``local`` are Ray's to resolve, and not probed."""
    target = address.removeprefix("ray://")
    if target in ("auto", "local") or ":" not in target:
        return None
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        reason = (
            "nothing listens on that port"
            if isinstance(exc, ConnectionRefusedError)
            else str(exc) or type(exc).__name__
        )
    return (
        f"RAY_ADDRESS={address}: no Ray cluster answers there ({reason}); start it (`ray start --head "
        "--port PORT` on its head node) or unset RAY_ADDRESS to let the run start a cluster of its own"
    )


def local_cluster_cpus() -> int:
    """The CPUs of the cluster a run starts for itself: ``RAGEN_RAY_NUM_CPUS``, else this machine's."""
    value = os.environ.get("RAGEN_RAY_NUM_CPUS")
    if not value:
        return os.cpu_count() or 1
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"RAGEN_RAY_NUM_CPUS={value!r} is not a whole number of CPUs") from None


def init_ray(
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    object_store_memory: int = 512 * 1024**2,
    address: str | None = None,
    env_vars: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start or join Ray once per process; returns ``ray.cluster_resources()``.

    ``address`` (default ``$RAY_ADDRESS``) joins an existing cluster. Otherwise a new local cluster
    is started, even when another one runs on this machine, with ``num_cpus`` (default
    ``$RAGEN_RAY_NUM_CPUS`` or the machine's CPU count), an object store capped at
    ``object_store_memory`` bytes, every process bound to 127.0.0.1, and token authentication
    (unless ``RAY_AUTH_MODE`` is set). Workers get ``RAY_ENV`` (+ ``env_vars``) as environment
    variables; the project is importable there because it is installed in the venv.
    """
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    with ray_sessions.keeps_sigterm_handler():
        _start_or_join(num_cpus, num_gpus, object_store_memory, address, env_vars)
    resources: dict[str, Any] = ray.cluster_resources()
    return resources


def _start_or_join(
    num_cpus: int | None,
    num_gpus: int | None,
    object_store_memory: int,
    address: str | None,
    env_vars: dict[str, str] | None,
) -> None:
    """:func:`init_ray`'s work: join ``address`` or start a cluster of our own; nothing when Ray is up."""
    if not ray.is_initialized():
        runtime_env = {"env_vars": {**RAY_ENV, **(env_vars or {})}}
        address = address or os.environ.get("RAY_ADDRESS") or None
        if address:
            problem = ray_address_problem(address)
            if problem:
                raise RayAddressError(problem)
            ray.init(
                address=address, runtime_env=runtime_env, logging_level=logging.WARNING, log_to_driver=True
            )
        else:
            if num_cpus is None:
                num_cpus = local_cluster_cpus()
            _token_auth()
            ray_sessions.remove_stale_sessions()
            with _loopback_node(), ray_sessions.named_start_failure():
                # "local": a new cluster. Without it ray.init() joins whatever cluster another process
                # registered in /tmp/ray, and then refuses num_cpus ("When connecting to an existing
                # cluster, num_cpus and num_gpus must not be provided").
                ray.init(
                    address="local",
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    object_store_memory=object_store_memory,
                    include_dashboard=False,
                    runtime_env=runtime_env,
                    logging_level=logging.WARNING,
                    log_to_driver=True,
                )
            ray_sessions.claim_new_session()
            node_ip = node_ip_address()
            if not ipaddress.ip_address(node_ip).is_loopback:
                ray.shutdown()
                raise RuntimeError(
                    f"the local Ray cluster came up on {node_ip}, not on 127.0.0.1: this Ray "
                    f"version ({ray.__version__}) needs a new way to keep it on loopback"
                )


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Start Ray's node on 127.0.0.1: then the GCS, raylet, agents and workers bind loopback only.

    ``ray.init`` turns a loopback ``_node_ip_address`` into the machine's routable address, and its
    processes listen on every interface unless the node address is loopback. Ray picks loopback
    itself where multi-node clusters are off (``ray_constants.ENABLE_RAY_CLUSTER``, false on
    macOS/Windows); that flag is read when the node starts, so it is switched off around the start.
    ``init_ray`` checks the outcome (the node's address), so a Ray that renames the flag fails loudly.
    """
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _token_auth() -> None:
    """Turn on Ray's token auth for a cluster we start, the token in ``<state>/ray/auth_token`` (0600).

    An explicit ``RAY_AUTH_MODE`` wins. Ray would write its own default token to ``~/.ray``; the
    state folder keeps it with the run (``RAY_AUTH_TOKEN_PATH=<state>/ray/auth_token ray status``
    reaches the cluster). Ray reads the mode into its C++ config at import, hence the reload.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = Path(
        os.environ.setdefault("RAY_AUTH_TOKEN_PATH", str(state_dir().resolve() / "ray" / "auth_token"))
    )
    if not path.is_file() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        # not in Ray's _raylet.pyi stub; a Ray without them takes the except branch
        from ray._raylet import (  # type: ignore[attr-defined]
            AuthenticationMode,
            Config,
            get_authentication_mode,
        )

        Config.initialize("")
        on = get_authentication_mode() == AuthenticationMode.TOKEN
    except (ImportError, AttributeError):
        on = False
    if not on:  # a half-enabled mode (processes with a token, this driver without) cannot start at all
        os.environ["RAY_AUTH_MODE"] = "disabled"
        logging.getLogger(__name__).warning(
            "Ray token auth could not be enabled; the cluster is on loopback only"
        )


def _get_all(refs: list[ray.ObjectRef[_R]]) -> list[_R]:
    """``ray.get`` of every ref; on failure the others are still collected (no "unhandled error" noise).

    When a rank was lost (its actor, worker or node died), the others fail first, in the collective
    ("Connection closed by peer"): the loss is the error raised then, so that the caller can tell it
    from a bug and rebuild."""
    try:
        return ray.get(refs)
    except BaseException as first:
        lost = None
        for ref in refs:
            try:
                ray.get(ref, timeout=60)
            except BaseException as exc:
                if lost is None and ray_actor_lost(exc):
                    lost = exc
        if lost is not None and not ray_actor_lost(first):
            raise lost from first
        raise


def _build_model(factory: ModelFactory) -> torch.nn.Module:
    if callable(factory):
        return factory()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(factory), dtype=torch.float32)


class LearnerWorker:
    """The body of a ``LearnerActor`` (usable in-process too): one rank of the learner group."""

    def __init__(
        self,
        cfg: dict[str, Any] | LearnerConfig,
        model_factory: ModelFactory,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.cfg = LearnerConfig.model_validate(cfg) if isinstance(cfg, dict) else cfg
        self.model_factory = model_factory
        self.rank, self.world_size = rank, world_size
        self.learner: Learner | None = None
        self._store_socket: socket.socket | None = None  # rank 0's, from rendezvous_address

    # -- set-up, called by LearnerGroup in this order
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port on it where rank 0's TCP store will listen (called on rank 0).

        The socket is bound here, to the node's address only, and handed to the store: torch's
        TCPStore would otherwise listen on every interface (and a port merely found free could be
        taken before the store binds it).
        """
        try:
            host = node_ip_address()
        except Exception:  # not inside Ray
            host = "127.0.0.1"
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        self._store_socket = sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(128)
        port: int = sock.getsockname()[1]
        return host, port

    def init_process_group(self, host: str, port: int, backend: str, timeout_s: float = 300.0) -> None:
        if ipaddress.ip_address(host).is_loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = timedelta(seconds=timeout_s)
        listen = self._store_socket if self.rank == 0 else None
        # TCPStore is public API; torch.distributed imports it without listing it in __all__
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host,
            port,
            self.world_size,
            is_master=self.rank == 0,
            timeout=timeout,
            master_listen_fd=listen.fileno() if listen is not None else None,
        )
        dist.init_process_group(
            backend=backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
        )

    def build(self) -> int:
        """Build the model and the learner (after the process group: rank 0's weights are broadcast)."""
        device = "cuda" if self.cfg.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        if device == "cuda" and dist.is_initialized():
            torch.cuda.set_device(0)  # Ray gives each actor its own CUDA_VISIBLE_DEVICES
        self.learner = Learner(_build_model(self.model_factory), self.cfg, device=device)
        return sum(p.numel() for p in self.learner.policy.parameters())

    # -- work
    def step(
        self,
        batch: TokenBatch,
        turn_scores: torch.Tensor | None = None,
        advantage_scale: float = 1.0,
        behaviour_logprobs: bool = False,
    ) -> dict[str, float]:
        assert self.learner is not None
        return self.learner.step(batch, turn_scores, advantage_scale, behaviour_logprobs)

    def get_weights(self) -> dict[str, torch.Tensor]:
        assert self.learner is not None
        return self.learner.policy_state_dict()

    def cross_logprobs(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        assert self.learner is not None
        return self.learner.cross_logprobs(prompts, responses)

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
        if self._store_socket is not None:
            self._store_socket.close()
            self._store_socket = None


#: The Ray actor class; resources are set per instance with ``.options`` (see ``LearnerGroup``).
LearnerActor = ray.remote(LearnerWorker)


class LearnerPlacementError(RuntimeError):
    """The Ray cluster cannot hold the learner group (message: the keys to change and what it has)."""

    user_error = True  # ragen_core.errors: the CLI prints the message as one line, no traceback


def _cluster_summary() -> tuple[float, float, float, int, float]:
    """(total CPUs, free CPUs, total GPUs, alive nodes, CPUs of the biggest node)."""
    total: dict[str, float] = ray.cluster_resources()
    free: dict[str, float] = ray.available_resources()
    nodes = alive_nodes()
    biggest = max((n.get("Resources", {}).get("CPU", 0.0) for n in nodes), default=0.0)
    return total.get("CPU", 0.0), free.get("CPU", 0.0), total.get("GPU", 0.0), len(nodes), biggest


def reserve_learners(cfg: LearnerConfig, world_size: int, timeout_s: float) -> PlacementGroup:
    """A ready placement group of ``world_size`` bundles of one learner's resources, or LearnerPlacementError.

    A group that can never fit (more than the cluster has, or a bundle bigger than any node) fails
    at once; one that does not fit now fails after ``timeout_s`` seconds of waiting for resources.
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": float(cfg.num_cpus), **({"GPU": float(cfg.num_gpus)} if cfg.num_gpus > 0 else {})}
    need_cpu, need_gpu = world_size * cfg.num_cpus, world_size * cfg.num_gpus

    def error(why: str) -> LearnerPlacementError:
        total_cpu, free_cpu, total_gpu, n_nodes, biggest = _cluster_summary()
        return LearnerPlacementError(
            f"cannot place trainer.learners={world_size} learner actors with learner.num_cpus={cfg.num_cpus:g}"
            f" and learner.num_gpus={cfg.num_gpus:g} each: {why}; the Ray cluster has {total_cpu:g} CPUs "
            f"({free_cpu:g} free, at most {biggest:g} on one node) and {total_gpu:g} GPUs on {n_nodes} node(s). "
            "Lower trainer.learners or learner.num_cpus (the rollout actor takes trainer.rollout_cpus too), "
            "or give Ray more (RAGEN_RAY_NUM_CPUS, or a cluster via RAY_ADDRESS)"
        )

    total_cpu, _, total_gpu, _, biggest = _cluster_summary()
    if need_cpu > total_cpu or need_gpu > total_gpu or cfg.num_cpus > biggest:
        raise error(f"they need {need_cpu:g} CPUs and {need_gpu:g} GPUs in all")
    group: PlacementGroup = placement_group(
        [dict(bundle) for _ in range(world_size)], strategy=cfg.placement.upper()
    )
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        raise error(f"their {need_cpu:g} CPUs were not free within {timeout_s:g} s")
    return group


class LearnerGroup:
    """K learner actors training one policy data-parallel; call it like a single ``Learner``.

    Args:
        cfg: learner config; ``num_cpus`` / ``num_gpus`` are the resources of *each* actor.
        model_factory: a picklable zero-argument callable returning the policy model (e.g.
            ``functools.partial(Qwen2ForCausalLM.from_pretrained, path)``) or a model directory.
            Rank 0's weights are broadcast to the others, so it need not be deterministic.
        world_size: number of learner actors.
        backend: ``torch.distributed`` backend; default gloo on CPU, nccl on GPU.
        placement_timeout_s: how long to wait for the group's resources to be free (see
            ``reserve_learners``); a group the cluster can never hold fails without waiting.
    """

    def __init__(
        self,
        cfg: LearnerConfig,
        model_factory: ModelFactory,
        world_size: int = 1,
        backend: str | None = None,
        placement_timeout_s: float = 30.0,
    ) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not ray.is_initialized():
            init_ray()
        self.cfg, self.world_size = cfg, world_size
        self.backend = backend or ("nccl" if cfg.num_gpus > 0 else "gloo")
        self.actors: list[LearnerHandle] = []
        # All ranks or none: a rank started while its peer waits for a CPU sits at the rendezvous
        # until the process-group timeout (300 s), then fails with "1/2 clients joined".
        self.placement: PlacementGroup | None = reserve_learners(cfg, world_size, placement_timeout_s)
        cfg_dict = cfg.model_dump(mode="json")
        try:
            self.actors = [
                cast(
                    LearnerHandle,
                    LearnerActor.options(
                        num_cpus=cfg.num_cpus,
                        num_gpus=cfg.num_gpus,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            self.placement, placement_group_bundle_index=rank
                        ),
                    ).remote(cfg_dict, model_factory, rank, world_size),
                )
                for rank in range(world_size)
            ]
            if world_size > 1:
                host, port = ray.get(self.actors[0].rendezvous_address.remote())
                _get_all([a.init_process_group.remote(host, port, self.backend) for a in self.actors])
            self.num_params = _get_all([a.build.remote() for a in self.actors])[0]
        except BaseException:
            self.shutdown()
            raise

    def step(
        self,
        batch: TokenBatch,
        turn_scores: torch.Tensor | None = None,
        advantage_scale: float = 1.0,
        behaviour_logprobs: bool = False,
    ) -> dict[str, float]:
        """One learner step on the whole (filtered) batch; returns rank 0's (global) metrics."""
        ref = ray.put(batch)
        calls = [a.step.remote(ref, turn_scores, advantage_scale, behaviour_logprobs) for a in self.actors]
        return _get_all(calls)[0]

    def cross_logprobs(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """``Learner.cross_logprobs`` on every learner (each scores its share of the rows); rank 0's result."""
        return _get_all([a.cross_logprobs.remote(prompts, responses) for a in self.actors])[0]

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (CPU tensors, plain model names; LoRA merged) for rollout actors."""
        return ray.get(self.actors[0].get_weights.remote())

    def save_checkpoint(
        self, path: str | os.PathLike[str], iteration: int, extra: dict[str, Any] | None = None
    ) -> Path:
        results = _get_all([a.save_checkpoint.remote(str(path), iteration, extra) for a in self.actors])
        saved = results[0]
        assert saved is not None  # rank 0 saves, the other ranks return None
        return Path(saved)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        return _get_all([a.load_checkpoint.remote(str(path)) for a in self.actors])[0]

    def shutdown(self) -> None:
        """Leave the process group, stop the actors and free their reserved resources."""
        if self.actors:
            with contextlib.suppress(Exception):  # the actors are killed below anyway
                ray.get([a.close.remote() for a in self.actors], timeout=60)
            for actor in self.actors:
                kill_actor(actor)
            self.actors = []
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # Ray may be gone already (interpreter exit)
                remove_placement_group(self.placement)
            self.placement = None

    def __enter__(self) -> LearnerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
