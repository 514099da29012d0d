"""Checks that need the machine, made before a run folder exists: the rollout engine, devices, the
Ray cluster that ``RAY_ADDRESS`` names, the run root and its free disk."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ragen_core.config import RagenConfig
from ragen_core.state_folder import runs_dir
from ragen_core.storage import existing_ancestor


class PreflightError(ValueError):
    """The config cannot run on this machine; the message says what to change."""


def _local_cluster_problems(cfg: RagenConfig) -> list[str]:
    """The run's own Ray cluster gets this machine's CPUs (or ``RAGEN_RAY_NUM_CPUS``): actors that
    cannot all fit there would otherwise fail after the warm start. (A cluster given by RAY_ADDRESS
    is checked when the run places its actors, at once.)"""
    from ragen_core.learner.actors import local_cluster_cpus

    t, learner = cfg.trainer, cfg.learner
    try:
        have = local_cluster_cpus()
    except ValueError as exc:
        return [str(exc)]
    problems = []
    need = t.rollout_cpus + t.learners * learner.num_cpus
    if need > have:
        problems.append(
            f"trainer.learners={t.learners} x learner.num_cpus={learner.num_cpus:g} + trainer.rollout_cpus="
            f"{t.rollout_cpus:g} = {need:g} CPUs, and the run's Ray cluster has {have:g} (this machine's CPUs, "
            "or RAGEN_RAY_NUM_CPUS); lower them, or set RAY_ADDRESS to a bigger cluster"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need_gpus = t.rollout_gpus + t.learners * learner.num_gpus
    if gpus and need_gpus > gpus:
        problems.append(
            f"trainer.learners={t.learners} x learner.num_gpus={learner.num_gpus:g} + trainer.rollout_gpus="
            f"{t.rollout_gpus:g} = {need_gpus:g} GPUs, and this machine has {gpus}; lower them, or set "
            "RAY_ADDRESS to a cluster with more GPUs"
        )
    return problems


def spelling_problems(cfg: RagenConfig, tokenizer: Any = None) -> list[str]:
    """With constrained action decoding, the policy's tokenizer must spell every action of the train and
    validation envs (``ActionGrammar`` refuses one it cannot), and on the vllm engine in at most the
    distinct tokens vLLM reports log-probs for. A tiny model's tokenizer is trained in the
    run, so only a saved or imported model's (or ``tokenizer``) is checked here."""
    if cfg.agent.action_decoding != "constrained":
        return []
    if tokenizer is None:
        if cfg.model.builds_tiny:
            return []
        from ragen_core.config.model import ModelNotFoundError
        from ragen_core.models.policies import load_tokenizer

        try:
            source = cfg.model.source()
            assert source is not None  # None only for the tiny model, which returned above
            tokenizer = load_tokenizer(source)
        except (ModelNotFoundError, OSError, ValueError):
            return []  # reported by the model check
    from ragen_core.config import played_actions
    from ragen_core.rollout.constrained import ActionGrammar, ConstraintError

    problems: list[str] = []
    for _, tag, actions in played_actions(cfg):
        try:
            grammar = ActionGrammar.for_protocol(tokenizer, actions or [], cfg.agent)
        except ConstraintError as exc:
            message = f"{tag}: {exc}"
        else:
            if cfg.rollout.engine != "vllm":
                continue
            from ragen_core.rollout.vllm_engine import grammar_size_problem

            problem = grammar_size_problem(grammar)
            if problem is None:
                continue
            message = f"{tag}: {problem}"
        if message not in problems:
            problems.append(message)
    return problems


def preflight(cfg: RagenConfig, min_free_gb: float = 1.0) -> None:
    """Checks that need the machine, before any work: engine, devices, the run folder and its disk."""
    from ragen_core.run.state_checks import state_problems

    problems = state_problems(cfg.tracking) + _engine_problems(cfg) + model_problems(cfg)
    problems += spelling_problems(cfg)
    problems += _device_problems(cfg)
    problems += remote_env_problems(cfg)
    problems += _run_root_problems(cfg, min_free_gb)
    if problems:
        raise PreflightError("cannot start this run:\n  " + "\n  ".join(problems))


def remote_env_problems(cfg: RagenConfig) -> list[str]:
    """Each server of ``train.remote`` / ``val.remote``: up, speaking OpenEnv with a text action, and
    (ours) playing the config's settings; asked once per server and tag, before any work."""
    from envs.wire.client import RemoteEnvError
    from ragen_core.env_groups import remote_maker

    problems: list[str] = []
    for key, groups in (("train.remote", cfg.train), ("val.remote", cfg.val)):
        for tag, remote in groups.remote.items():
            try:
                remote_maker(tag, remote, groups.env_overrides.get(tag, {}))
            except (RemoteEnvError, ValueError) as exc:
                problems.append(f"{key}.{tag}: {exc}")
    return problems


def model_problems(cfg: RagenConfig) -> list[str]:
    """An imported model that is missing, and a local model folder whose weight files are broken
    (checked from their headers: a corrupt file otherwise fails inside the model load)."""
    from ragen_core.config.model import ModelNotFoundError
    from ragen_core.models.weights_check import WeightsFileError, check_model_folder

    try:
        source = cfg.model.source()
        if source is not None:
            check_model_folder(source)
    except (ModelNotFoundError, WeightsFileError) as exc:
        return [str(exc)]
    return []


def _engine_problems(cfg: RagenConfig) -> list[str]:
    """With ``rollout.engine=vllm``: whether vLLM runs here, and takes the tiny model's head size."""
    import subprocess

    problems: list[str] = []
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
    return problems


def _device_problems(cfg: RagenConfig) -> list[str]:
    """The Ray cluster (local or ``RAY_ADDRESS``) and the GPUs the config asks for."""
    problems: list[str] = []
    remote = bool(os.environ.get("RAY_ADDRESS"))
    if not remote and cfg.trainer.backend == "ray":
        problems += _local_cluster_problems(cfg)
    if remote and cfg.trainer.backend == "ray":
        from ragen_core.learner.actors import ray_address_problem

        problem = ray_address_problem(os.environ["RAY_ADDRESS"])
        if problem:
            problems.append(problem)
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
    return problems


def _run_root_problems(cfg: RagenConfig, min_free_gb: float) -> list[str]:
    """The run root: a writable folder (or one that can be made) with ``min_free_gb`` free on its disk."""
    import shutil

    root = runs_dir(cfg.trainer.run_root)
    probe = existing_ancestor(root)
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        return [
            f"trainer.run_root={root}: {probe} is not a writable folder; choose another "
            "--set trainer.run_root"
        ]
    free_gb = shutil.disk_usage(probe).free / 2**30
    if free_gb < min_free_gb:
        return [
            f"trainer.run_root={root}: only {free_gb:.2f} GiB free on its disk (checkpoints need "
            f"more than {min_free_gb} GiB); free space or choose another run root"
        ]
    return []


def checkpoint_disk_gib(cfg: RagenConfig) -> float | None:
    """At least what a new run's checkpoints will hold, in GiB (the critic, with GAE, comes on top).

    With ``W`` = the policy's weights x the bytes of ``model.dtype``: the starting policy twice
    (``init_policy``, ``init_checkpoint``), ``W`` for each of ``trainer.iterations`` checkpoints (with
    ``trainer.keep_policies``: the last N and the validated ones), and AdamW's two moments (``2W``) in the
    last ``trainer.keep_optimizer_states`` of those (in all when it is unset). None where that is small
    or unknown: the tiny model, LoRA (its checkpoints hold the adapter), a folder without safetensors
    weights."""
    from ragen_core.config.model import ModelNotFoundError
    from ragen_core.models.policies import torch_dtype
    from ragen_core.models.weights_check import parameter_count
    from ragen_core.run.stages import eval_due

    if cfg.model.builds_tiny or cfg.learner.lora.rank > 0:
        return None
    try:
        source = cfg.model.source()
    except ModelNotFoundError:
        return None  # model_problems says so
    weights = parameter_count(source) if source and Path(source).is_dir() else None
    if weights is None:
        return None
    w = weights * torch_dtype(cfg.model.dtype).itemsize / 2**30
    t = cfg.trainer
    with_weights = t.iterations
    if t.keep_policies is not None:  # the last N and the validated ones
        with_weights = sum(
            j > t.iterations - t.keep_policies or eval_due(cfg, j) for j in range(1, t.iterations + 1)
        )
    with_optimiser = min(with_weights, t.keep_optimizer_states or with_weights)
    return (with_weights + 2) * w + with_optimiser * 2 * w


def disk_warning(cfg: RagenConfig) -> str | None:
    """One line when a new run's checkpoints (:func:`checkpoint_disk_gib`) will not fit on the run
    root's disk: such a run stops where the disk fills, which can be an hour in. A warning, not an
    error: the estimate leaves out what other runs free or take meanwhile."""
    import shutil

    need = checkpoint_disk_gib(cfg)
    if need is None:
        return None
    root = runs_dir(cfg.trainer.run_root)
    free = shutil.disk_usage(existing_ancestor(root)).free / 2**30
    if need <= free:
        return None
    keep = "".join(
        f", --set trainer.{key}=2"
        for key in ("keep_optimizer_states", "keep_policies")
        if getattr(cfg.trainer, key) is None
    )
    return (
        f"trainer.run_root={root}: this run's {cfg.trainer.iterations} checkpoints will take about "
        f"{need:.1f} GiB and its disk has {free:.1f} GiB free: the run stops when the disk fills (`ragen "
        f"train --resume` continues it once there is room); free space, choose another --set "
        f"trainer.run_root{keep} or fewer trainer.iterations"
    )


def learnability_check(cfg: RagenConfig) -> None:
    """``trainer.probe``: the learnability check of ``ragen probe`` before a new run (not after a warm
    start, which changes the policy it would judge). ``warn`` logs a no-go with its reason and advice;
    ``error`` raises it as a :class:`PreflightError`, before the run folder exists."""
    if cfg.trainer.probe == "off" or cfg.sft is not None:
        return
    import logging

    from ragen_core.run.probe import probe

    # never more than an iteration plays; chance (thousands of random episodes) is `ragen probe`'s alone
    result = probe(cfg, groups=min(4, cfg.train.num_groups), chance=False)
    log = logging.getLogger("ragen.progress")
    if result.go:
        log.info("learnability probe: %s", result.lines()[0])
        return
    report = "\n  ".join(result.lines())
    if cfg.trainer.probe == "error":
        raise PreflightError(f"the learnability probe says no-go (trainer.probe=error):\n  {report}")
    log.warning("learnability probe (trainer.probe=warn; error stops such a run):\n  %s", report)
