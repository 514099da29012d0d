"""``ragen rerun``: recompute one stage of a stored iteration from what is on disk, into its own
folder, and compare it with the stored result (nothing stored is overwritten)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ragen_core.config import RagenConfig
from ragen_core.filter_record import kept_rows_of
from ragen_core.integrity import CorruptFileError
from ragen_core.run import stage_record
from ragen_core.run.run_dir import RunDir
from ragen_core.run.session import Session
from ragen_core.run.stages import behaviour_policy, check_init_policy, play, update_policy
from ragen_core.trajectory import read_table, schema_version, write_table


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


def rerun_config(run: RunDir, k: int) -> RagenConfig:
    """The run's config as iteration ``k`` ran: with the learner count its learn stage recorded
    (``trainer.learners`` may change on resume, and with it the float summation order of a step)."""
    cfg = run.config()
    learners = stage_record.made_with(run.stage_record("learn", k)).get("learners")
    if learners is None or learners == cfg.trainer.learners:
        return cfg
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"learners": int(learners)})})


def rerun_stage(
    run: RunDir, k: int, stage: str, out_dir: str | Path | None = None, backend: str | None = None
) -> RerunResult:
    """Recompute one stage of iteration ``k`` from what is on disk, into ``out_dir`` (default
    ``<run>/reruns/iter_k``), and compare it with the stored result. Nothing stored is overwritten.

    ``rollout``: the policy that played iteration ``k`` (``stages.behaviour_policy``: the one it starts
    from, after ``k - 1`` or a rollback's target; one-step off-policy, the one before) plays its seeds -> Parquet
    (compared byte for byte). ``learn``: the learner state iteration ``k`` starts from, on the stored
    rollouts and filter -> checkpoint (policy and critic compared bitwise). ``evaluate``: validation
    of the policy after ``k`` iterations (compared byte for byte).

    Every stored input and the stored result are checked against the digests recorded when they
    were written: a damaged file raises an error naming it (``CorruptFileError``,
    ``TrajectoryFileError``, ``CheckpointError``) instead of a "different" verdict that would blame
    reproducibility. A damaged stored result is reported after the rerun, whose output is kept.
    """
    cfg = rerun_config(run, k)
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
            session.restore(behaviour_policy(cfg, run, k))
            table, _ = play(cfg, run, session, "train", k)
            out = write_table(table, out_dir / "rollouts.parquet")
            _check_stored_table(run.rollouts(k), out)
            return RerunResult(stage, k, out, run.rollouts(k), *_same_tables(out, run.rollouts(k)))
        if stage == "evaluate":
            session.restore(k)
            table, _ = play(cfg, run, session, "val", k)
            out = write_table(table, out_dir / "eval.parquet")
            stored = run.eval_file(k)
            if not stored.exists():
                return RerunResult(stage, k, out, stored, False, "no stored evaluation at this step")
            _check_stored_table(stored, out)
            return RerunResult(stage, k, out, stored, *_same_tables(out, stored))
        from ragen_core.learner.checkpoint import CheckpointError, verify_checkpoint

        session.restore(run.start_of(k))  # load_checkpoint verifies the checkpoint it starts from
        kept = kept_rows_of(run.read_json(run.filter_file(k)))
        update_policy(cfg, session, read_table(run.rollouts(k)), kept)
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


#: The MLflow tags of a rerun's record: its stage, iteration (evaluate: the step) and verdict.
RERUN_STAGE_TAG, RERUN_ITERATION_TAG, RERUN_VERDICT_TAG = (
    "ragen.rerun.stage",
    "ragen.rerun.iteration",
    "ragen.rerun.verdict",
)


def rerun_markdown(run_id: str, result: RerunResult, mlflow_run: str | None) -> str:
    """A rerun's verdict as markdown (the rerun flow run's artifact): identical or not, why, and where
    the rerun's output, the stored output it was compared with and its MLflow record are."""
    verdict = "identical" if result.identical else "different"
    lines = [
        f"## Rerun of {result.stage}, iteration {result.k} of `{run_id}`: **{verdict}**",
        "",
        result.detail,
        "",
        f"- rerun output: `{result.output}`",
        f"- stored output: `{result.stored}`",
        f"- MLflow: run `{mlflow_run}`, nested under the training run"
        if mlflow_run
        else "- MLflow: not recorded (the training run has no MLflow run, or its store failed)",
    ]
    return "\n".join(lines) + "\n"


def log_rerun(run: RunDir, result: RerunResult, state: Path) -> str | None:
    """Record a rerun in MLflow, beside what it checked: a run nested under the training run (in the
    training run's store and experiment), named ``rerun-<stage>@iter<k>``, with the stage, iteration
    and verdict (``identical`` / ``different``) as tags and the detail as its description; its id.
    None when the training run has no MLflow run (tracking was off or failed); a store that fails now
    is one warning, never the rerun's verdict."""
    from ragen_core.state_folder import index_entry
    from ragen_core.tracking.tracker import Tracker

    parent = run.info().get("mlflow_run_id")
    if not parent:
        return None
    verdict = "identical" if result.identical else "different"
    try:
        tracker = Tracker(run.config().tracking, state)
        mlflow_run = tracker.start(
            f"rerun-{result.stage}@iter{result.k}",
            {"stage": result.stage, "iteration": result.k},
            tags={
                RERUN_STAGE_TAG: result.stage,
                RERUN_ITERATION_TAG: str(result.k),
                RERUN_VERDICT_TAG: verdict,
                "ragen.rerun.output": index_entry(result.output),
                "mlflow.note.content": f"{result.stage} of iteration {result.k} rerun: **{verdict}** "
                f"({result.detail})",
            },
            parent_run_id=parent,
        )
        tracker.end()
    except Exception as exc:  # a record is a courtesy: the verdict stands without it
        import logging

        logging.getLogger(__name__).warning("the rerun was not recorded in MLflow: %s", exc)
        return None
    return None if tracker.offline else mlflow_run


_NOT_COMPARED = "The stored result is damaged, so the rerun compared nothing; its own output is {out}"


def _check_stored_table(stored: Path, out: Path) -> None:
    """The stored result of a rollout / evaluate rerun must be intact to be compared with."""
    from ragen_core.trajectory import TrajectoryFileError

    try:
        read_table(stored)
    except TrajectoryFileError as exc:
        raise TrajectoryFileError(f"{exc}. {_NOT_COMPARED.format(out=out)}") from exc


def _same_tables(out: Path, stored: Path) -> tuple[bool, str]:
    """Byte-for-byte; a stored file of trajectory schema v1 (written before its ``iteration`` column
    was numbered like the folders) is compared on every other column, since the rerun writes v2."""
    if out.read_bytes() == stored.read_bytes():
        return True, "byte-identical Parquet"
    if schema_version(stored) == "1":
        a, b = read_table(out).drop_columns(["iteration"]), read_table(stored).drop_columns(["iteration"])
        if a.equals(b):
            return (
                True,
                "identical rows (the stored file is trajectory schema v1: its iteration column held the seed round)",
            )
    return False, "Parquet files differ"


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
