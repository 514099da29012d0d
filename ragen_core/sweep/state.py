"""What a sweep remembers between runs: its parent run and each member's run and status.

``<state>/sweeps/<name>-<hash>/state.json`` is saved after every change, so running the same sweep
again (after a crash or a kill) finds its members' runs and resumes them instead of starting over.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ragen_core.run.run_lock import RunLock
from ragen_core.storage import write_text_whole
from ragen_core.sweep.spec import SweepConfig, sweep_hash

MemberStatus = Literal["pending", "running", "finished", "failed"]


class MemberState(BaseModel):
    """What the sweep knows of one member (``state.json``)."""

    status: MemberStatus = "pending"
    run_id: str | None = None  # ragen run id
    #: the run directory as the run index records it: relative to the state folder when inside it, so
    #: a copied or moved state folder resumes its own runs (read it with :meth:`run_path`)
    run_dir: str | None = None
    mlflow_run_id: str | None = None
    attempts: int = 0
    error: str | None = None
    last_iteration: int | None = None
    flow_run_id: str | None = None  # a member dispatched to a deployment's workers: its flow run
    updated: float = Field(default_factory=time.time)

    def run_path(self) -> Path | None:
        """The member's run directory here (None before it has one)."""
        from ragen_core.state_folder import indexed_run

        return indexed_run(self.run_dir) if self.run_dir else None


class SweepState(BaseModel):
    """``<state>/sweeps/<name>-<hash>/state.json``: the parent run and each member's run."""

    name: str
    hash: str
    sweep_file: str
    parent_run_id: str | None = None
    members: dict[str, MemberState] = Field(default_factory=dict)

    @staticmethod
    def folder(state_dir: str | os.PathLike[str], sweep: SweepConfig) -> Path:
        # the hash in the name: a changed definition is a new sweep with its own state
        return Path(state_dir) / "sweeps" / f"{sweep.name}-{sweep_hash(sweep)}"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SweepState | None:
        p = Path(path)
        return cls.model_validate_json(p.read_text()) if p.is_file() else None

    def save(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_text_whole(p, self.model_dump_json(indent=2))  # a kill mid-write leaves the previous state


def sweep_lock(folder: str | os.PathLike[str]) -> RunLock:
    """The lock of the sweep whose state is in ``folder`` (``<folder>/LOCK``, the run lock's code):
    one ``ragen sweep run`` holds it while it runs the members, so a second one of the same sweep is
    refused, naming the holder; the kernel drops it when its holder dies, and the next run takes over."""
    return RunLock(folder, what="sweep", again="run it again (it resumes)")
