"""A training run as plain functions over a run directory: the stages the Prefect flows wrap.

The run directory is the single source of truth (full map: docs/architecture.md, "Run directory"):
every stage reads its inputs from it and writes its outputs into it, so any stage of any iteration
can be rerun from disk, and a run killed at any point resumes from its last completed iteration.
Iterations are numbered from 1; step 0 is the policy before training (its validation, if
configured).

    <run>/config.yaml, run.json                 the config and the run's identity
    <run>/init_policy/                          the starting policy (after the warm start)
    <run>/iter_0001/rollouts.parquet            train trajectories of iteration 1
    <run>/iter_0001/filter.json                 rows kept by the StarPO-S filter + its stats
    <run>/iter_0001/checkpoint/                 learner state after iteration 1 (policy in HF format)
    <run>/iter_0001/metrics.json, DONE          all metrics of the iteration; the completion mark
    <run>/eval/step_0001.parquet                validation trajectories after iteration 1
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import yaml

from ragen_core import stage_record
from ragen_core.algorithms import group_std_stats, select_groups
from ragen_core.config import ConfigError, RagenConfig, config_hash, dump_config, load_config
from ragen_core.errors import RagenError
from ragen_core.faults import crash_point
from ragen_core.integrity import CorruptFileError, record, record_tree, verify, verify_tree
from ragen_core.state_folder import state_dir
from ragen_core.storage import as_os_error, existing_ancestor, write_error
from ragen_core.trajectory import read_table, to_token_batch, write_table


class RunFileError(RagenError, ValueError):
    """A file of a run directory that cannot be read (not JSON, not a config); names the file and the fix."""


# ------------------------------------------------------------------------------------ run dir
class RunDir:
    """Paths of one run; nothing here touches torch or Ray."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    # identity and config
    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def info_path(self) -> Path:
        return self.root / "run.json"

    @property
    def init_policy(self) -> Path:
        return self.root / "init_policy"

    def info(self) -> dict[str, Any]:
        return self.read_json(self.info_path) if self.info_path.exists() else {}

    def read_json(self, path: str | os.PathLike[str]) -> Any:
        """A JSON file of this run, checked against the digest recorded when it was written; a
        corrupt or unparsable file raises ``CorruptFileError`` / ``RunFileError`` naming it."""
        path = Path(path)
        fix = self._repair(path)
        verify(path, fix=fix)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise RunFileError(f"{path}: missing. {fix}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunFileError(f"{path}: not valid JSON ({exc}). {fix}") from exc

    def _repair(self, path: Path) -> str:
        """What a user can do about a damaged file of this run (said in the error). Files of an
        iteration are recomputed by resuming from before it: its stages replay what is damaged
        (``stage_record``) and reuse what is intact."""
        if path == self.info_path:
            return (
                "Restore it from a copy; it holds the run's identity (run_id, config_hash, mlflow_run_id), "
                "which cannot be recomputed"
            )
        if path == self.config_path:
            return "Restore it from a copy (the run's MLflow artifacts hold config.yaml), or start a new run"
        top = path.relative_to(self.root).parts[0] if path.is_relative_to(self.root) else ""
        k = int(top[5:]) if top.startswith("iter_") and top[5:].isdigit() else None
        if path.parent == self.root / "eval" and path.stem.startswith("step_") and path.stem[5:].isdigit():
            k = int(path.stem[5:]) or None  # step 0 (before training) belongs to no iteration
            if k is None:
                return (
                    f"Restore it from a copy, or recompute it into {self.root / 'reruns'} with "
                    f"`ragen rerun {self.root} --iteration 0 --stage evaluate`"
                )
        if k is not None:
            return (
                f"Restore it from a copy, or delete {self.done_file(k)} and resume the run "
                f"(`ragen train --resume`): iteration {k} is recomputed from its intact inputs"
            )
        return "Restore it from a copy"

    def update_info(self, **values: Any) -> dict[str, Any]:
        info = {**self.info(), **values}
        atomic_write_text(self.info_path, json.dumps(info, indent=2, sort_keys=True))
        return info

    def config(self) -> RagenConfig:
        """The run's config, checked against its recorded digest; a damaged file names itself."""
        if not self.config_path.is_file():
            raise RunFileError(f"{self.config_path}: missing; {self.root} is not a complete run directory")
        verify(self.config_path, fix=self._repair(self.config_path))
        try:
            return load_config(self.config_path)
        except ConfigError as exc:  # its message names the file already; the fix differs for a run's copy
            raise RunFileError(
                f"{' '.join(str(exc).split())}. It is this run's stored config: "
                f"{self._repair(self.config_path)}"
            ) from exc
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise RunFileError(
                f"{self.config_path}: not valid YAML ({' '.join(str(exc).split())}). "
                f"{self._repair(self.config_path)}"
            ) from exc

    # per iteration
    def iter_dir(self, k: int) -> Path:
        return self.root / f"iter_{k:04d}"

    def rollouts(self, k: int) -> Path:
        return self.iter_dir(k) / "rollouts.parquet"

    def filter_file(self, k: int) -> Path:
        return self.iter_dir(k) / "filter.json"

    def checkpoint(self, k: int) -> Path:
        """Learner state after ``k`` iterations (``k = 0``: the fresh learner, saved once per run)."""
        return self.root / "init_checkpoint" if k == 0 else self.iter_dir(k) / "checkpoint"

    def policy_after(self, k: int) -> Path:
        """The policy weights after ``k`` iterations (``init_policy`` for 0)."""
        return self.init_policy if k == 0 else self.checkpoint(k) / "policy"

    def metrics_file(self, k: int) -> Path:
        return self.iter_dir(k) / "metrics.json"

    def done_file(self, k: int) -> Path:
        return self.iter_dir(k) / "DONE"

    def eval_file(self, step: int) -> Path:
        return self.root / "eval" / f"step_{step:04d}.parquet"

    def eval_metrics_file(self, step: int) -> Path:
        return self.root / "eval" / f"step_{step:04d}.json"

    def stage_record(self, stage: str, k: int) -> Path:
        """What stage ``stage`` of iteration ``k`` (``evaluate``: step ``k``) made, and from what."""
        folder = self.root / "eval" if stage == "evaluate" else self.iter_dir(k)
        return folder / "stages" / (f"step_{k:04d}.json" if stage == "evaluate" else f"{stage}.json")

    def last_complete(self) -> int:
        """The last iteration whose DONE mark exists and all before it too (0 if none)."""
        k = 0
        while self.done_file(k + 1).exists():
            k += 1
        return k

    # Echo-Trap rollbacks: an append-only log beside the iterations, which it never rewrites, so
    # every stored iteration stays rerunnable bitwise.
    def rollback_file(self, k: int) -> Path:
        """The rollback decided after iteration ``k`` (``{"after", "to", "signals", "at"}``), if any."""
        return self.root / "rollbacks" / f"after_{k:04d}.json"

    def rolled_back_to(self, k: int) -> int | None:
        """Where the rollback after iteration ``k`` went back to (None: there was none)."""
        f = self.rollback_file(k)
        return int(self.read_json(f)["to"]) if k > 0 and f.exists() else None

    def start_of(self, k: int) -> int:
        """The iteration whose state iteration ``k`` starts from: ``k - 1``, or the earlier iteration
        that a rollback after ``k - 1`` went back to."""
        to = self.rolled_back_to(k - 1)
        return k - 1 if to is None else to

    def best_step(self, last: int) -> int | None:
        """The validated step up to ``last`` with the highest validation success (the earliest of
        equals; None: none validated)."""
        best, best_value = None, -1.0
        for step in range(0, last + 1):
            f = self.eval_metrics_file(step)
            if f.exists():
                value = self.read_json(f).get("val-env/success", -1.0)
                if value > best_value:
                    best, best_value = step, value
        return best


def atomic_write_text(path: Path, text: str, *, record_digest: bool = True) -> None:
    """Write ``text`` atomically (temp file, fsync, rename) and record its sha256 in the folder's
    ``SHA256SUMS`` (``record_digest=False``: a mark whose existence is its content, like DONE).

    An ``OSError`` (full disk, read-only folder) is raised as ``StorageWriteError`` naming ``path``.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if record_digest:
            record(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from exc


#: files at least this large are identified by (size, mtime_ns), not hashed: a 0.5B-parameter
#: checkpoint (policy + critic + optimiser, ~12 GB in float32) would take tens of seconds to hash at
#: every cache-key lookup. Rewriting a file changes its mtime, so a change still misses the cache.
DIGEST_BY_STAT_BYTES = 64 * 2**20
_DIGESTS: dict[str, tuple[tuple[int, int, int], str]] = {}


def _one_digest(p: Path) -> str:
    st = p.stat()
    ident = (st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _DIGESTS.get(str(p))
    if cached is not None and cached[0] == ident:
        return cached[1]  # unchanged since last hashed in this process
    if st.st_size >= DIGEST_BY_STAT_BYTES:
        digest = f"stat:{st.st_size}:{st.st_mtime_ns}"
    else:
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
    _DIGESTS[str(p)] = (ident, digest)
    return digest


def file_digest(path: Path) -> str:
    """Digest of a file, or of a directory's files (names and per-file digests, sorted).

    Per file: sha256 of its bytes, or ``(size, mtime_ns)`` for files of
    :data:`DIGEST_BY_STAT_BYTES` or more; memoised per process while the file is unchanged.
    """
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            h.update(str(p.relative_to(path)).encode())
        h.update(_one_digest(p).encode())
    return h.hexdigest()


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Make a checkpoint's policy folder a complete Hugging Face model (weights + tokenizer)."""
    import shutil

    for name in _TOKENIZER_FILES:
        if (src / name).exists() and dst.is_dir():
            shutil.copy2(src / name, dst / name)


class PreflightError(ValueError):
    """The config cannot run on this machine; the message says what to change."""


def preflight(cfg: RagenConfig, min_free_gb: float = 1.0) -> None:
    """Checks that need the machine, before any work: engine, devices, the run folder and its disk."""
    import shutil
    import subprocess

    problems = []
    if cfg.rollout.engine == "vllm":
        from ragen_core.rollout.vllm_engine import VLLMUnavailableError, check_vllm, cpu_head_size_problem

        try:
            check_vllm()
        except (VLLMUnavailableError, OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"rollout.engine=vllm: {exc}")
        m = cfg.model  # a tiny model is built from these; a saved one is checked when its engine starts
        problem = cpu_head_size_problem(m.hidden_size // m.num_heads) if m.builds_tiny else None
        if problem:
            problems.append(f"rollout.engine=vllm: {problem}")
    if cfg.model.imported is not None:
        from ragen_core.models import ModelNotFoundError

        try:
            cfg.model.source()
        except ModelNotFoundError as exc:
            problems.append(str(exc))
    remote = bool(os.environ.get("RAY_ADDRESS"))
    if not remote and not torch.cuda.is_available():
        if cfg.learner.num_gpus > 0:
            problems.append(
                f"learner.num_gpus={cfg.learner.num_gpus} but this machine has no GPU; "
                "--set learner.num_gpus=0 (or set RAY_ADDRESS to a cluster with GPUs)"
            )
        if cfg.trainer.rollout_gpus > 0:
            problems.append(
                f"trainer.rollout_gpus={cfg.trainer.rollout_gpus} but this machine has no GPU; "
                "--set trainer.rollout_gpus=0"
            )
    root = Path(cfg.trainer.run_root or state_dir() / "runs")
    probe = existing_ancestor(root)
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        problems.append(
            f"trainer.run_root={root}: {probe} is not a writable folder; choose another "
            "--set trainer.run_root"
        )
    else:
        free_gb = shutil.disk_usage(probe).free / 2**30
        if free_gb < min_free_gb:
            problems.append(
                f"trainer.run_root={root}: only {free_gb:.2f} GiB free on its disk (checkpoints need "
                f"more than {min_free_gb} GiB); free space or choose another run root"
            )
    if problems:
        raise PreflightError("cannot start this run:\n  " + "\n  ".join(problems))


def _index_path() -> Path:
    return state_dir() / "runs.json"


#: A run name: letters, digits, ``-``, ``_`` and ``.``, starting with a letter or digit, so that it is
#: one folder name under the run root (no ``..``, no ``/``, no absolute path) and fits in an MLflow
#: run name with the hash and random suffix that ``create_run`` appends.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class RunNameError(RagenError, ValueError):
    """A run name that is not one safe folder name."""


def check_run_name(name: str, source: str = "--name") -> str:
    """``name`` if it is a valid run name, else :class:`RunNameError` naming ``source`` and the rule."""
    if not RUN_NAME.fullmatch(name):
        shown = name if len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)"
        raise RunNameError(
            f"{source} {shown!r} is not a valid run name: use 1-64 letters, digits, '-', '_' "
            "or '.', starting with a letter or digit"
        )
    return name


def run_name(
    cfg: RagenConfig, name: str | None = None, config_path: str | os.PathLike[str] | None = None
) -> str:
    """The name of a new run: ``name`` (``--name``), else ``trainer.run_name``, else the config file's
    stem, else ``run``; checked by :func:`check_run_name`."""
    if name:
        return check_run_name(name)
    if cfg.trainer.run_name:
        return check_run_name(cfg.trainer.run_name, "trainer.run_name")
    if config_path is not None:
        stem = to_run_name(Path(config_path).stem)
        if stem:
            return check_run_name(stem, "the config file name")
    return "run"


def to_run_name(text: str) -> str:
    """``text`` made a valid run name (other characters become ``-``, cut to 64), or ``""``: for
    names made from other names (a config file, a sweep member's key)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text).lstrip("-_.")[:64]


def create_run(
    cfg: RagenConfig, name: str | None = None, root: str | os.PathLike[str] | None = None
) -> RunDir:
    """A new run directory with its config; the run id is ``<name>-<config hash>-<random>``.

    ``name`` defaults to ``trainer.run_name`` or ``run`` and must pass :func:`check_run_name`. The id is
    recorded in the state folder's run index, so ``--resume ID`` finds the run wherever its
    ``trainer.run_root`` put it.
    """
    chash = config_hash(cfg)
    name = check_run_name(name) if name else run_name(cfg)
    run_id = f"{name}-{chash[:8]}-{uuid.uuid4().hex[:6]}"
    run = RunDir(Path(root or cfg.trainer.run_root or state_dir() / "runs") / run_id)
    try:
        run.root.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise OSError(
            f"cannot create run directory {run.root}: {exc.strerror}; check trainer.run_root "
            "is writable and the disk has space"
        ) from exc
    record(dump_config(cfg, run.config_path))
    run.update_info(run_id=run_id, config_hash=chash, created=time.time())
    _index_add(run_id, run.root.resolve())
    return run


def _index_add(run_id: str, root: Path) -> None:
    """Add a run to the state folder's index; a lock beside it keeps concurrent new runs' entries."""
    import fcntl

    _index_path().parent.mkdir(parents=True, exist_ok=True)
    with open(_index_path().with_name(".runs.json.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = json.loads(_index_path().read_text()) if _index_path().exists() else {}
        index[run_id] = str(root)
        atomic_write_text(_index_path(), json.dumps(index, indent=1, sort_keys=True), record_digest=False)


def find_run(run_id_or_path: str, run_root: str | os.PathLike[str] | None = None) -> RunDir:
    """A run by directory, by id (the state folder's run index), or by id under ``run_root``."""
    p = Path(run_id_or_path)
    candidates = [p]
    if _index_path().exists():
        known = json.loads(_index_path().read_text()).get(run_id_or_path)
        if known:
            candidates.append(Path(known))
    default_root = Path(run_root or state_dir() / "runs")
    candidates.append(default_root / run_id_or_path)
    for c in candidates:
        if (c / "config.yaml").is_file():
            return RunDir(c)
    raise FileNotFoundError(
        f"no run {run_id_or_path!r}: not a run directory, not in the run index {_index_path()}, and not "
        f"under {default_root}; pass the run directory"
    )


# ------------------------------------------------------------------------------------ session
class Session:
    """The live parts of a run: a rollout worker and a learner (group), kept across iterations.

    ``backend="ray"`` runs them as Ray actors (resources from the config); ``"local"`` keeps them
    in this process (tests, debugging, the overhead baseline). Weights go from the learner to the
    rollout worker after every learner step; ``at`` records which iteration's weights they hold.
    """

    def __init__(self, cfg: RagenConfig, run: RunDir, backend: str = "ray") -> None:
        from ragen_core.actors import LearnerGroup, LearnerWorker, init_ray
        from ragen_core.rollout.worker import RolloutActor, RolloutWorker

        self.cfg, self.run, self.backend = cfg, run, backend
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
        self.at = 0
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

    def restore(self, k: int) -> None:
        """Put the learner and the rollout worker at the state after iteration ``k``."""
        if k == self.at:
            return
        self.learner.load_checkpoint(str(self.run.checkpoint(k)))
        self.call_worker("load_weights_from", str(self.run.policy_after(k)))
        self.at = k

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


# ------------------------------------------------------------------------------------ stages
def init_policy_stage(cfg: RagenConfig, run: RunDir) -> Path:
    """The starting policy in ``<run>/init_policy``: the configured model, warm-started by SFT if set.

    Written to a temporary folder and renamed, so a killed warm start leaves nothing half-made.
    """
    import shutil

    from ragen_core.models import policy_from_config, save_policy
    from ragen_core.sft import warm_start

    if (run.init_policy / "config.json").exists():
        check_init_policy(run)
        return run.init_policy
    tmp = run.root / f".init_policy.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if cfg.sft is not None:
            warm_start(cfg.model, cfg.sft, tmp, protocol=cfg.agent)
        else:
            model, tokenizer = policy_from_config(cfg.model)
            save_policy(model, tokenizer, tmp)
        record_tree(tmp)  # inside the folder, before the rename: the digests travel with it
        os.replace(tmp, run.init_policy)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = as_os_error(exc, run.init_policy)
        if os_error is None:
            raise
        raise write_error(run.init_policy, os_error, "the starting policy") from exc
    return run.init_policy


def check_init_policy(run: RunDir) -> None:
    """Verify ``<run>/init_policy`` against its ``SHA256SUMS`` before a learner or a rollout worker
    loads it (runs from before digests have none and pass)."""
    verify_tree(
        run.init_policy,
        fix="Restore the folder from a copy, or start a new run: every iteration of "
        "this run was trained from it",
    )


def check_resumable(run: RunDir) -> int:
    """What a resume starts from, checked before anything is started or written: every complete
    iteration's metrics (re-logged to MLflow) and the state after the last one. Returns that
    iteration; a damaged file raises naming it."""
    from ragen_core.learner import verify_checkpoint

    last = run.last_complete()
    for k in range(1, last + 1):
        run.read_json(run.metrics_file(k))
    start = run.start_of(last + 1)
    if start > 0:
        verify_checkpoint(run.checkpoint(start))
    elif run.init_policy.exists():
        check_init_policy(run)
    return last


def _sampling(cfg: RagenConfig, split: str) -> dict[str, Any]:
    r = cfg.rollout
    temperature = r.temperature if split == "train" else r.val_temperature
    return {
        "temperature": temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "max_new_tokens": r.max_new_tokens,
    }


def play(cfg: RagenConfig, run: RunDir, session: Session, split: str, k: int = 1) -> tuple[pa.Table, dict]:
    """One episode per env of ``split`` with the session's current policy: iteration ``k``'s train
    seeds, or the fixed validation seeds. Shared by the stages and their reruns."""
    iteration = k - 1 if split == "train" else 0
    return session.call_worker(
        "rollout", split, iteration, _sampling(cfg, split), cfg.trainer.seed, run.info().get("run_id", "")
    )


def _response_metrics(table: pa.Table, prefix: str) -> dict[str, float]:
    masks = table.column("loss_mask").to_pylist()
    lengths = [sum(m) for m in masks]
    infos = [json.loads(s) for s in table.column("info").to_pylist()]
    n = max(len(lengths), 1)
    return {
        f"{prefix}response_length/mean": sum(lengths) / n,
        f"{prefix}response_length/max": float(max(lengths, default=0)),
        f"{prefix}response_length/clip_ratio": sum(1 for i in infos if i.get("response_truncated")) / n,
        f"{prefix}score/mean": sum(table.column("score").to_pylist()) / n,
    }


def rollout_stage(cfg: RagenConfig, run: RunDir, k: int, session: Session) -> tuple[Path, dict[str, float]]:
    """Iteration ``k``'s train rollouts with the policy it starts from (after ``k - 1`` iterations, or
    where a rollback went back to: :meth:`RunDir.start_of`).

    Reuses this run's stored rollouts when they are intact and were played by the same policy
    (``ragen_core.stage_record``), so a resumed iteration does not play again."""
    start = run.start_of(k)
    record, inputs = run.stage_record("rollout", k), {"policy": run.policy_after(start)}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        return run.rollouts(k), stored["metrics"]
    session.restore(start)
    t0 = time.perf_counter()
    table, env_metrics = play(cfg, run, session, "train", k)
    crash_point("rollout", k)
    path = write_table(table, run.rollouts(k))
    seconds = time.perf_counter() - t0
    tokens = sum(sum(m) for m in table.column("loss_mask").to_pylist())
    metrics = {f"train/{key}": v for key, v in env_metrics.items()}
    metrics.update(_response_metrics(table, ""))
    metrics.update({"timing_s/gen": seconds, "perf/rollout_tokens_per_s": tokens / max(seconds, 1e-9)})
    stage_record.save(record, inputs, [path], metrics)
    return path, metrics


def filter_stage(cfg: RagenConfig, run: RunDir, k: int) -> tuple[list[int], dict[str, float]]:
    """StarPO-S: keep whole groups with the largest in-group score std (``rollout.filter_ratio`` of
    them); writes the kept rows and the group statistics to the iteration's ``filter.json``."""
    rollouts, out = run.rollouts(k), run.filter_file(k)
    record, inputs = run.stage_record("filter", k), {"rollouts": rollouts}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        return stored["extra"]["kept_rows"], stored["metrics"]
    table = read_table(rollouts)
    scores = torch.tensor(table.column("score").to_pylist(), dtype=torch.float64)
    groups = torch.tensor(table.column("group_id").to_pylist(), dtype=torch.int64)
    r = cfg.rollout
    keep = select_groups(scores, groups, r.filter_ratio, mode=r.filter_type)
    kept = torch.nonzero(keep).flatten().tolist()
    before, after = group_std_stats(scores, groups), group_std_stats(scores[keep], groups[keep])
    metrics = {f"rollout/{k}": float(v) for k, v in before.items()}
    metrics.update({f"rollout/chosen_{k}": float(v) for k, v in after.items()})
    metrics["rollout/kept_trajectories"] = float(len(kept))
    atomic_write_text(out, json.dumps({"kept_rows": kept, "metrics": metrics}, indent=1))
    stage_record.save(record, inputs, [out], metrics, {"kept_rows": kept})
    return kept, metrics


def learn_stage(cfg: RagenConfig, run: RunDir, k: int, session: Session, kept: list[int]) -> dict[str, float]:
    """One learner step on the kept trajectories; saves the checkpoint of iteration ``k``."""
    rollouts = run.rollouts(k)
    record = run.stage_record("learn", k)
    start = run.start_of(k)
    inputs = {"state": run.checkpoint(start), "rollouts": rollouts, "filter": run.filter_file(k)}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        return stored["metrics"]
    session.restore(start)
    table = read_table(rollouts).take(pa.array(kept, type=pa.int64()))
    t0 = time.perf_counter()
    metrics = session.learner.step(to_token_batch(table))
    metrics["timing_s/update"] = time.perf_counter() - t0
    crash_point("learn", k)
    t0 = time.perf_counter()
    session.learner.save_checkpoint(str(run.checkpoint(k)), k)
    copy_tokenizer(run.init_policy, run.checkpoint(k) / "policy")
    metrics["timing_s/checkpoint"] = time.perf_counter() - t0
    session.sync_weights()
    session.at = k
    stage_record.save(record, inputs, [run.checkpoint(k)], metrics)
    return metrics


def evaluate_stage(
    cfg: RagenConfig, run: RunDir, step: int, session: Session
) -> tuple[Path, dict[str, float]]:
    """Validation rollouts (fixed seeds, validation temperature) of the policy after ``step`` iterations."""
    record, inputs = run.stage_record("evaluate", step), {"policy": run.policy_after(step)}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        return run.eval_file(step), stored["metrics"]
    session.restore(step)
    t0 = time.perf_counter()
    table, env_metrics = play(cfg, run, session, "val")
    path = write_table(table, run.eval_file(step))
    metrics = {f"val-env/{key}": v for key, v in env_metrics.items()}
    metrics.update(_response_metrics(table, "val/"))
    metrics["timing_s/testing"] = time.perf_counter() - t0
    atomic_write_text(run.eval_metrics_file(step), json.dumps(metrics, indent=1, sort_keys=True))
    stage_record.save(record, inputs, [path, run.eval_metrics_file(step)], metrics)
    return path, metrics


def eval_due(cfg: RagenConfig, step: int) -> bool:
    t = cfg.trainer
    if step == 0:
        return t.val_before_train
    return step == t.iterations or (t.eval_every > 0 and step % t.eval_every == 0)


def finish_iteration(run: RunDir, k: int, metrics: Mapping[str, float]) -> None:
    atomic_write_text(run.metrics_file(k), json.dumps(dict(metrics), indent=1, sort_keys=True))
    # The empty mark carries no data to corrupt: one SHA256SUMS rewrite (and fsync) less per iteration.
    atomic_write_text(run.done_file(k), "", record_digest=False)


# ------------------------------------------------------------------------------------ reruns
@dataclass
class RerunResult:
    stage: str
    k: int
    output: Path
    stored: Path
    identical: bool
    detail: str


def _tensors_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> tuple[bool, str]:
    if set(a) != set(b):
        return False, f"different tensors: {sorted(set(a) ^ set(b))[:5]}"
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    return not diff, ("bitwise identical" if not diff else f"{len(diff)} tensors differ, e.g. {diff[:3]}")


def rerun_stage(
    run: RunDir, k: int, stage: str, out_dir: Path | None = None, backend: str | None = None
) -> RerunResult:
    """Recompute one stage of iteration ``k`` from what is on disk, into ``out_dir`` (default
    ``<run>/reruns/iter_k``), and compare it with the stored result. Nothing stored is overwritten.

    ``rollout``: the policy iteration ``k`` starts from (after ``k - 1``, or a rollback's target) plays iteration ``k``'s seeds -> Parquet
    (compared byte for byte). ``learn``: the learner state iteration ``k`` starts from, on the stored
    rollouts and filter -> checkpoint (policy and critic compared bitwise). ``evaluate``: validation
    of the policy after ``k`` iterations (compared byte for byte).

    Every stored input and the stored result are checked against the digests recorded when they
    were written: a damaged file raises an error naming it (``CorruptFileError``,
    ``TrajectoryFileError``, ``CheckpointError``) instead of a "different" verdict that would blame
    reproducibility. A damaged stored result is reported after the rerun, whose output is kept.
    """
    cfg = run.config()
    if stage not in ("rollout", "learn", "evaluate"):
        raise ValueError(f"unknown stage {stage!r}; use rollout, learn or evaluate")
    if not 1 <= k <= run.last_complete() and not (stage == "evaluate" and k == 0):
        raise ValueError(
            f"iteration 0 has no {stage} stage: iterations start at 1 (step 0 can only be evaluated)"
            if k == 0
            else f"iteration {k} of {run.root} is not complete (last complete: {run.last_complete()})"
        )
    check_init_policy(run)  # both the learner and the rollout worker start from it
    out_dir = Path(out_dir or run.root / "reruns" / f"iter_{k:04d}")
    out_dir.mkdir(parents=True, exist_ok=True)
    # The run's own backend by default: Ray actors run torch with their CPU count as thread count,
    # and float sums (so bitwise results) depend on it.
    session = Session(cfg, run, backend=backend or cfg.trainer.backend)
    try:
        if stage == "rollout":
            session.restore(run.start_of(k))
            table, _ = play(cfg, run, session, "train", k)
            out = write_table(table, out_dir / "rollouts.parquet")
            _check_stored_table(run.rollouts(k), out)
            same = out.read_bytes() == run.rollouts(k).read_bytes()
            return RerunResult(
                stage,
                k,
                out,
                run.rollouts(k),
                same,
                "byte-identical Parquet" if same else "Parquet files differ",
            )
        if stage == "evaluate":
            session.restore(k)
            table, _ = play(cfg, run, session, "val")
            out = write_table(table, out_dir / "eval.parquet")
            stored = run.eval_file(k)
            if stored.exists():
                _check_stored_table(stored, out)
            same = stored.exists() and out.read_bytes() == stored.read_bytes()
            return RerunResult(
                stage,
                k,
                out,
                stored,
                same,
                "byte-identical Parquet"
                if same
                else ("no stored evaluation at this step" if not stored.exists() else "Parquet files differ"),
            )
        from ragen_core.learner import CheckpointError, verify_checkpoint

        session.restore(run.start_of(k))  # load_checkpoint verifies the checkpoint it starts from
        kept = run.read_json(run.filter_file(k))["kept_rows"]
        table = read_table(run.rollouts(k)).take(pa.array(kept, type=pa.int64()))
        session.learner.step(to_token_batch(table))
        out = out_dir / "checkpoint"
        session.learner.save_checkpoint(str(out), k)
        stored = run.checkpoint(k)
        try:
            verify_checkpoint(stored)
            stored_policy = _read_weights(stored / "policy" / "model.safetensors")
            stored_critic = (
                _read_weights(stored / "critic.safetensors")
                if (stored / "critic.safetensors").exists()
                else None
            )
        except (CheckpointError, CorruptFileError) as exc:
            raise type(exc)(f"{exc}. {_NOT_COMPARED.format(out=out)}") from exc
        same_policy, d1 = _tensors_equal(_read_weights(out / "policy" / "model.safetensors"), stored_policy)
        same, detail = same_policy, f"policy: {d1}"
        if stored_critic is not None:
            same_critic, d2 = _tensors_equal(_read_weights(out / "critic.safetensors"), stored_critic)
            same, detail = same and same_critic, f"{detail}; critic: {d2}"
        return RerunResult(stage, k, out, stored, same, detail)
    finally:
        session.close()


_NOT_COMPARED = "The stored result is damaged, so the rerun compared nothing; its own output is {out}"


def _check_stored_table(stored: Path, out: Path) -> None:
    """The stored result of a rollout / evaluate rerun must be intact to be compared with."""
    from ragen_core.trajectory import TrajectoryFileError

    try:
        read_table(stored)
    except TrajectoryFileError as exc:
        raise TrajectoryFileError(f"{exc}. {_NOT_COMPARED.format(out=out)}") from exc


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; an unreadable file raises ``CorruptFileError`` naming it."""
    import safetensors
    import safetensors.torch

    try:
        return safetensors.torch.load_file(str(path))
    except (safetensors.SafetensorError, OSError) as exc:
        raise CorruptFileError(
            f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}"
        ) from exc
