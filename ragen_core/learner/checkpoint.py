"""Learner checkpoints on disk: the atomic write, the manifest with a sha256 of every file, checked reads.

A checkpoint is a folder (``<run>/iter_K/checkpoint``) holding everything a learner needs to resume:

- ``policy/``: Hugging Face ``save_pretrained`` (safetensors; only the adapter with LoRA);
- ``critic.safetensors``: the critic (GAE only);
- ``optim.pt``: optimisers, schedulers and the step counters;
- ``rng.pt``: torch, CUDA, numpy and Python RNG states;
- ``manifest.json``: format, iteration, the model signature (what must match to load it), the
  learner config, the caller's ``extra``, the sha256 of every other file under ``files`` and its own
  under ``manifest_sha256``;
- ``OPTIM_PRUNED``, only when ``checkpoint_pruning.prune_optimizer_state`` removed ``optim.pt`` (a run's
  ``trainer.keep_optimizer_states``): the weights stay readable, a learner cannot continue from it.
- ``WEIGHTS_PRUNED``, only when ``checkpoint_pruning.prune_weights`` removed the weights, the critic
  and ``optim.pt`` (a run's ``trainer.keep_policies``): the manifest and RNG states stay as the record
  of the step, and every read names the note.

:func:`write_checkpoint` writes into a temporary folder and renames it over the old one only once it
is complete. :func:`read_checkpoint` reads and checks everything (digests, signature, shapes) before
the learner changes anything, so a damaged checkpoint or one of another model leaves it as it was;
every error is a ``CheckpointError`` naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import numpy as np
import safetensors.torch
import torch
from torch import nn

from ragen_core.config.learner import LearnerConfig
from ragen_core.faults import crash_point
from ragen_core.integrity import sha256_file
from ragen_core.storage import as_os_error, write_error

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from peft import PeftModel
    from transformers import PreTrainedModel

#: The note that replaces a pruned ``optim.pt`` (``checkpoint_pruning.prune_optimizer_state``).
OPTIM_PRUNED = "OPTIM_PRUNED"
#: The note that replaces a checkpoint's pruned weights (``checkpoint_pruning.prune_weights``).
WEIGHTS_PRUNED = "WEIGHTS_PRUNED"

__all__ = [
    "CHECKPOINT_FORMAT",
    "MANIFEST",
    "OPTIM_PRUNED",
    "WEIGHTS_PRUNED",
    "CheckpointError",
    "LearnerState",
    "LoadedCheckpoint",
    "load_into",
    "load_learner",
    "manifest_digest",
    "merged_policy_state",
    "model_signature",
    "read_checkpoint",
    "save_learner",
    "set_rng_state",
    "verify_checkpoint",
    "write_checkpoint",
]

_T = TypeVar("_T")

CHECKPOINT_FORMAT = 1
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this learner (missing, corrupt, or another model)."""

    user_error = True


# --------------------------------------------------------------------------------------------------
# Write
# --------------------------------------------------------------------------------------------------


def model_signature(policy: nn.Module, critic: nn.Module | None, cfg: LearnerConfig) -> dict[str, Any]:
    """What must match for a checkpoint to fit: architecture, config hash, parameter shapes."""
    lora = cfg.lora.rank > 0
    config = getattr(policy, "config", None)
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

    base = cast("PeftModel", policy).get_base_model() if lora else policy
    return {
        "architecture": type(base).__name__,
        "model_type": cfg_dict.get("model_type"),
        "config_sha256": hashlib.sha256(cfg_json.encode()).hexdigest(),
        "policy_shapes_sha256": shapes(policy),
        "critic": None if critic is None else cfg.optim.critic,
        "critic_shapes_sha256": shapes(critic),
        "lora": cfg.lora.model_dump() if lora else None,
    }


def write_checkpoint(
    path: str | os.PathLike[str],
    iteration: int,
    *,
    policy: nn.Module,
    critic: nn.Module | None,
    training_state: dict[str, Any],
    cfg: LearnerConfig,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a learner's state into ``path`` atomically (temp dir, then rename); returns ``path``.

    ``training_state`` (optimisers, schedulers, ``global_step`` and the other counters) goes into
    ``optim.pt``; the RNG states are taken here. An existing ``path`` is replaced only once the new
    one is complete. An ``OSError`` (full disk) is raised as ``StorageWriteError`` naming the
    checkpoint.
    """
    path = Path(path)
    tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
    old = path.parent / f"{path.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        cast("PreTrainedModel | PeftModel", policy).save_pretrained(
            str(tmp / "policy"), safe_serialization=True
        )
        if critic is not None:
            safetensors.torch.save_model(critic, str(tmp / "critic.safetensors"))
        torch.save(training_state, tmp / "optim.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        # One hash per written file, before the manifest that records them (load checks them all).
        files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "iteration": int(iteration),
            "global_step": training_state["global_step"],
            "signature": model_signature(policy, critic, cfg),
            "learner_config": cfg.model_dump(mode="json"),
            "extra": extra or {},
            "saved_at": time.time(),
            "files": files,
        }
        manifest = json.loads(json.dumps(manifest, default=str))  # what read_checkpoint will read back
        manifest["manifest_sha256"] = manifest_digest(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _fsync_tree(tmp)
        crash_point("checkpoint", int(iteration))
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException as exc:
        # judged before the partial files go: a short write on a full disk is told by the free space
        # left, and removing the half-written optim.pt (about 1 GB) frees it again
        os_error = as_os_error(exc, path)
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        if os_error is not None:
            raise write_error(path, os_error, "the checkpoint") from exc
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


# --------------------------------------------------------------------------------------------------
# Read
# --------------------------------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    """A checkpoint read into memory and checked against the learner it is for; nothing applied yet."""

    manifest: dict[str, Any]
    policy: dict[str, torch.Tensor]  # the full state dict, or the adapter's with LoRA
    critic: dict[str, torch.Tensor] | None  # None when the learner has no critic
    training_state: dict[str, Any]  # optim.pt: optimisers, schedulers, counters
    rng: dict[str, Any]  # rng.pt: for set_rng_state


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    policy: nn.Module,
    critic: nn.Module | None,
    cfg: LearnerConfig,
    actor_optim: torch.optim.Optimizer,
    critic_optim: torch.optim.Optimizer | None,
) -> LoadedCheckpoint:
    """Read a ``write_checkpoint`` folder for the learner made of these modules and optimisers.

    Everything is read and checked before the caller changes anything: a file whose sha256 differs
    from the manifest's (checked first, see :func:`verify_checkpoint`), a checkpoint of another model
    (architecture, config or parameter shapes), or a missing / unreadable file raises
    ``CheckpointError`` naming it.
    """
    path = Path(path)
    manifest = verify_checkpoint(path)
    if (path / OPTIM_PRUNED).exists():
        raise CheckpointError(
            f"{path}: its optimiser state was pruned (trainer.keep_optimizer_states, {path / OPTIM_PRUNED}), "
            "so a learner cannot continue from it; its policy weights remain (`ragen evaluate RUN@K`). "
            "Resume or rerun from an iteration that kept its optimiser state"
        )
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {manifest.get('format')}, expected {CHECKPOINT_FORMAT}"
        )
    mine, theirs = model_signature(policy, critic, cfg), manifest.get("signature", {})
    differ = [k for k in mine if mine[k] != theirs.get(k)]
    if differ:
        details = "; ".join(f"{k}: checkpoint {theirs.get(k)!r} vs this learner {mine[k]!r}" for k in differ)
        raise CheckpointError(
            f"{path}: checkpoint from another model or learner setup ({details}). Load it into a "
            "learner built from the same model (and critic / LoRA settings), or start a new run"
        )
    policy_sd = _read_policy(path / "policy", policy, lora=cfg.lora.rank > 0)
    critic_sd = None
    if critic is not None:
        critic_sd = _read_file(
            path / "critic.safetensors", lambda f: safetensors.torch.load_file(str(f)), path
        )
        _check_state(critic, critic_sd, path / "critic.safetensors")
    training_state = _read_file(
        path / "optim.pt", lambda f: torch.load(f, map_location="cpu", weights_only=True), path
    )
    rng = _read_file(path / "rng.pt", lambda f: torch.load(f, map_location="cpu", weights_only=True), path)
    _check_optim(actor_optim, training_state["actor_optim"], "actor")
    if critic_optim is not None:
        _check_optim(critic_optim, training_state["critic_optim"], "critic")
    return LoadedCheckpoint(manifest, policy_sd, critic_sd, training_state, rng)


def _read_policy(directory: Path, policy: nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    from ragen_core.models.policies import load_weight_files

    try:
        sd = load_weight_files(directory)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory}: no safetensors weights") from exc
    except ValueError as exc:  # models.load_weight_files names the unreadable file
        raise CheckpointError(str(exc)) from exc
    if lora:
        import peft

        expected = peft.get_peft_model_state_dict(policy)
        if set(expected) != set(sd) or any(expected[k].shape != sd[k].shape for k in sd):
            raise CheckpointError(f"{directory}: LoRA adapter does not match this learner's adapter")
        return sd
    _check_state(policy, sd, directory)
    return sd


# --------------------------------------------------------------------------------------------------
# Digests, checks and state helpers
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
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{path}: not a learner checkpoint (no {MANIFEST})")
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
    if (path / WEIGHTS_PRUNED).exists():
        reason = (path / WEIGHTS_PRUNED).read_text(errors="replace").strip()
        raise CheckpointError(
            f"{path}: the weights of {which} were {reason} ({path / WEIGHTS_PRUNED}); its rollouts and "
            "metrics remain, but it cannot be evaluated, played or continued from. Use a step that kept "
            "its weights: the validated steps and the last ones (`ragen evaluate RUN@K` lists them)"
        )
    pruned = (path / OPTIM_PRUNED).exists()
    for rel, expected in (manifest.get("files") or {}).items():
        if pruned and rel == "optim.pt":
            continue
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


def load_into(module: nn.Module, sd: dict[str, torch.Tensor]) -> None:
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


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the RNG states of a checkpoint's ``rng.pt`` (the CUDA ones only where CUDA is)."""
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
    """Flush every file under ``root`` to disk before the rename publishes them."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())


class LearnerState(Protocol):
    """What a learner holds that its checkpoint saves and restores (``ragen_core.learner.update.Learner``)."""

    global_step: int
    skipped_steps: int

    @property
    def policy(self) -> nn.Module: ...
    @property
    def critic(self) -> nn.Module | None: ...
    @property
    def cfg(self) -> LearnerConfig: ...
    @property
    def lora(self) -> bool: ...
    @property
    def actor_optim(self) -> torch.optim.Optimizer: ...
    @property
    def actor_sched(self) -> torch.optim.lr_scheduler.LRScheduler: ...
    @property
    def critic_optim(self) -> torch.optim.Optimizer | None: ...
    @property
    def critic_sched(self) -> torch.optim.lr_scheduler.LRScheduler | None: ...


def save_learner(
    learner: LearnerState, path: str | os.PathLike[str], iteration: int, extra: dict[str, Any] | None = None
) -> Path:
    """Write everything ``learner`` needs to resume into ``path`` atomically (the layout: this module's
    docstring); ``extra`` is stored in the manifest. An ``OSError`` (full disk) is
    raised as ``StorageWriteError`` naming the checkpoint."""
    training_state = {
        "actor_optim": learner.actor_optim.state_dict(),
        "actor_sched": learner.actor_sched.state_dict(),
        "critic_optim": None if learner.critic_optim is None else learner.critic_optim.state_dict(),
        "critic_sched": None if learner.critic_sched is None else learner.critic_sched.state_dict(),
        "global_step": learner.global_step,
        "skipped_steps": learner.skipped_steps,
    }
    return write_checkpoint(
        path,
        iteration,
        policy=learner.policy,
        critic=learner.critic,
        training_state=training_state,
        cfg=learner.cfg,
        extra=extra,
    )


def load_learner(learner: LearnerState, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore ``learner`` from a :func:`save_learner` folder; returns ``{"iteration", "global_step",
    "extra"}``.

    Everything is read and checked before anything is changed (``checkpoint.read_checkpoint``):
    a damaged file, a checkpoint of another model or a missing / unreadable file raises
    ``CheckpointError`` naming it and leaves this learner as it was.
    """
    ckpt = read_checkpoint(
        path,
        policy=learner.policy,
        critic=learner.critic,
        cfg=learner.cfg,
        actor_optim=learner.actor_optim,
        critic_optim=learner.critic_optim,
    )
    # Everything is readable and fits: apply.
    with torch.no_grad():
        if learner.lora:
            import peft

            peft.set_peft_model_state_dict(learner.policy, ckpt.policy)
        else:
            load_into(learner.policy, ckpt.policy)
        if learner.critic is not None:
            load_into(learner.critic, cast("dict[str, torch.Tensor]", ckpt.critic))  # read with the critic
    state = ckpt.training_state
    learner.actor_optim.load_state_dict(state["actor_optim"])
    learner.actor_sched.load_state_dict(state["actor_sched"])
    if learner.critic_optim is not None:
        learner.critic_optim.load_state_dict(state["critic_optim"])
        # built with critic_optim
        cast(torch.optim.lr_scheduler.LRScheduler, learner.critic_sched).load_state_dict(
            state["critic_sched"]
        )
    learner.global_step = int(state["global_step"])
    learner.skipped_steps = int(state["skipped_steps"])
    set_rng_state(ckpt.rng)
    return {
        "iteration": ckpt.manifest["iteration"],
        "global_step": learner.global_step,
        "extra": ckpt.manifest["extra"],
    }


def merged_policy_state(policy: nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """Full policy weights on CPU under the plain model's names (LoRA merged in), for rollout actors."""
    if not lora:
        return {k: v.detach().cpu().clone() for k, v in policy.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = cast("PeftModel", policy).get_base_model()
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
