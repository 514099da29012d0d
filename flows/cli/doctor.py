"""``ragen doctor``: the install checked (versions, state folder, torch device, vLLM, MLflow, Ray)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import console, prepare

if TYPE_CHECKING:
    from rich.console import Console

#: The packages a run needs; a missing one fails the check.
PACKAGES = ("torch", "transformers", "tokenizers", "prefect", "mlflow", "ray", "pyarrow", "pandas", "peft")


def _check_packages(out: Console) -> bool:
    import importlib.metadata as md

    ok = True
    for pkg in PACKAGES:
        try:
            out.print(f"[green]ok[/]   {pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            ok = False
            out.print(f"[red]MISSING[/] {pkg}: run `make setup`")
    return ok


def _check_devices(out: Console, state: Path) -> None:
    """Disk space of the state folder, torch's device, and vLLM (optional: never a failure)."""
    import shutil

    free = shutil.disk_usage(state).free / 2**30
    out.print(
        f"[{'green' if free > 5 else 'red'}]{'ok' if free > 5 else 'LOW'}[/]   state folder {state} "
        f"({free:.0f} GiB free)"
    )
    import torch

    gpu = (
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)"
        if torch.cuda.is_available()
        else "no GPU (CPU)"
    )
    out.print(f"[green]ok[/]   torch device: {gpu}")
    from ragen_core.rollout.vllm_engine import VLLMUnavailableError, check_vllm, vllm_python

    try:
        out.print(f"[green]ok[/]   vllm {check_vllm()} under {vllm_python()} (rollout.engine=vllm)")
    except (VLLMUnavailableError, OSError, subprocess.TimeoutExpired) as exc:
        out.print(f"[yellow]--[/]   rollout.engine=vllm unavailable: {exc}; rollout.engine=hf works")


def _check_mlflow(out: Console, state: Path) -> bool:
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.tracking.tracker import Tracker

    try:
        tracker = Tracker(TrackingConfig(), state)
        out.print(f"[green]ok[/]   MLflow store {tracker.tracking_uri}")
    except Exception as exc:
        out.print(f"[red]FAIL[/] MLflow: {exc}")
        return False
    return True


def _check_ray(out: Console) -> bool:
    """Start Ray as a run would, list its nodes (where learner and rollout actors can go), stop it."""
    t0 = time.perf_counter()
    try:
        import ray

        from ragen_core.learner.actors import init_ray

        resources = init_ray()
        where = os.environ.get("RAY_ADDRESS") or f"local, on {ray.util.get_node_ip_address()}"
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        out.print(
            f"[green]ok[/]   Ray: {resources.get('CPU', 0):.0f} CPUs, {resources.get('GPU', 0):.0f} GPUs "
            f"on {len(nodes)} node(s) ({where}, auth {os.environ.get('RAY_AUTH_MODE', 'default')}; "
            f"{time.perf_counter() - t0:.1f} s to start)"
        )
        for node in nodes:  # where learner and rollout actors can go (trainer.learners, *_cpus, *_gpus)
            have = node.get("Resources", {})
            out.print(
                f"       node {node.get('NodeManagerAddress')}: {have.get('CPU', 0):g} CPUs, "
                f"{have.get('GPU', 0):g} GPUs{' (head)' if 'node:__internal_head__' in have else ''}"
            )
        ray.shutdown()
    except Exception as exc:
        out.print(f"[red]FAIL[/] Ray: {exc}")
        return False
    return True


def _check_copied_state(out: Console, fix: bool) -> None:
    """A state folder copied or moved from another: where its records point, or (``fix``) what was
    pointed at it. Never a failure: ragen uses the folder's own files either way. Before the MLflow
    check, whose tracker would point the store at this folder itself."""
    from ragen_core.run.state_checks import copied_state_problem, relocate_state

    problem = copied_state_problem()
    if problem is None:
        return
    if not fix:
        out.print(f"[yellow]MOVED[/] {problem}")
        return
    for line in relocate_state():
        out.print(f"[green]fixed[/] {line}")


def doctor(
    fix: Annotated[
        bool,
        typer.Option(
            "--fix", help="Point a copied or moved state folder's records (runs.json, mlflow.db) at it."
        ),
    ] = False,
) -> None:
    """Check the install: versions, the state folders, Ray, MLflow's store, and any GPU."""
    state = prepare()
    out = console()
    ok = _check_packages(out)
    _check_devices(out, state)
    _check_copied_state(out, fix)
    ok = _check_mlflow(out, state) and ok
    ok = _check_ray(out) and ok
    if not ok:
        raise typer.Exit(1)
