"""``ragen rerun``: recompute one stage of a stored iteration from what is on disk, into its own
folder, and compare it with the stored result (nothing stored is overwritten)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ragen_core.config import RagenConfig
from ragen_core.filter_record import kept_rows_of
from ragen_core.integrity import CorruptFileError
from ragen_core.run import stage_record
from ragen_core.run.run_dir import RunDir
from ragen_core.run.session import Session
from ragen_core.run.stages import behaviour_policy, check_init_policy, play, update_policy
from ragen_core.trajectory import read_table, schema_version, write_table

if TYPE_CHECKING:
    from ragen_core.env_groups import RemoteEnvConfig


@dataclass
class RerunResult:
    stage: str
    k: int
    output: Path
    stored: Path
    identical: bool
    detail: str
    #: a rollout / evaluate rerun that differs because a remote tag's server answered the same seed and
    #: actions otherwise than it did in the run: ``"<tag> at <url>"`` (the detail says where)
    nondeterministic_server: str | None = None

    @property
    def verdict(self) -> str:
        """``identical``, ``different``, or ``non-deterministic server`` (the run cannot be reproduced
        against that server, which is not a fault of ours)."""
        if self.identical:
            return "identical"
        return "non-deterministic server" if self.nondeterministic_server else "different"


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
            return _table_result(stage, k, out, run.rollouts(k), cfg.train.remote)
        if stage == "evaluate":
            session.restore(k)
            table, _ = play(cfg, run, session, "val", k)
            out = write_table(table, out_dir / "eval.parquet")
            stored = run.eval_file(k)
            if not stored.exists():
                return RerunResult(stage, k, out, stored, False, "no stored evaluation at this step")
            _check_stored_table(stored, out)
            return _table_result(stage, k, out, stored, cfg.val.remote)
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
    verdict = result.verdict
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
    verdict = result.verdict.replace(" ", "-")  # a tag value to filter on: non-deterministic-server
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


def _table_result(
    stage: str, k: int, out: Path, stored: Path, remote: Mapping[str, RemoteEnvConfig]
) -> RerunResult:
    same, detail = _same_tables(out, stored)
    if same and remote:
        servers = ", ".join(f"{tag} at {r.url}" for tag, r in remote.items())
        detail = f"{detail}; the remote environments ({servers}) answered as in the run: deterministic"
    if same or not remote:
        return RerunResult(stage, k, out, stored, same, detail)
    server = _server_divergence(read_table(out).to_pylist(), read_table(stored).to_pylist(), remote)
    if server is None:
        return RerunResult(stage, k, out, stored, False, detail)
    tag, why = server
    return RerunResult(
        stage,
        k,
        out,
        stored,
        False,
        f"{detail}: non-deterministic server: {why}. A rollout played against a server that answers the "
        "same seed and actions differently cannot be reproduced; rerun it against a deterministic server",
        nondeterministic_server=f"{tag} at {remote[tag].url}",
    )


def _first_divergence(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[int, bool] | None:
    """Where episode ``a`` first parts from ``b``: (the index of the message, whether the environment
    said it: a system or user message, a reward, or an end); None when they do not part.

    Messages alternate in time (system, turn 1's observation, turn 1's answer, turn 2's observation
    and the reward of turn 1's actions, ...), so the index orders divergences across episodes too."""
    ma, mb = a["messages"] or [], b["messages"] or []
    for i, (x, y) in enumerate(zip(ma, mb, strict=False)):
        if x != y:
            return i, x["role"] != "assistant"
    if len(ma) != len(mb):
        return min(len(ma), len(mb)), True  # one episode ended after the same answer: the server said done
    ra, rb = a["turn_rewards"] or [], b["turn_rewards"] or []
    for j, (x, y) in enumerate(zip(ra, rb, strict=False)):
        if x != y:
            return 2 * j + 3, True  # turn j+1's reward comes with the observation after its answer
    return None


def _server_divergence(
    rerun: list[dict[str, Any]], stored: list[dict[str, Any]], remote: Mapping[str, RemoteEnvConfig]
) -> tuple[str, str] | None:
    """(tag, what it answered differently) when a remote tag's server is why the tables differ: some
    episode of that tag parts from the stored one first in what the environment said, and no episode
    parts earlier in what the policy said (an earlier different answer would be ours; one at the same
    turn or later may follow from the server's, since the policy plays the episodes in one batch)."""
    if len(rerun) != len(stored):
        return None
    policy_first: int | None = None
    server_first: tuple[int, str, str] | None = None
    for a, b in zip(rerun, stored, strict=True):
        if (a["env_id"], a["seed"], a["env_tag"]) != (b["env_id"], b["seed"], b["env_tag"]):
            return None  # not the same episodes: nothing to attribute
        where = _first_divergence(a, b)
        if where is None:
            continue
        index, by_env = where
        if by_env and a["env_tag"] in remote:
            if server_first is None or index < server_first[0]:
                server_first = (index, a["env_tag"], _server_said(a, b, index, remote[a["env_tag"]].url))
        elif policy_first is None or index < policy_first:
            policy_first = index
    if server_first is None or (policy_first is not None and policy_first < server_first[0]):
        return None
    return server_first[1], server_first[2]


def _server_said(a: Mapping[str, Any], b: Mapping[str, Any], index: int, url: str) -> str:
    """What the server at ``url`` answered otherwise at message ``index`` of episode ``a`` (``b`` stored)."""
    done = sum(1 for m in (b["messages"] or [])[:index] if m["role"] == "assistant")  # turns answered
    where = f"{a['env_tag']} at {url}, episode of seed {a['seed']} (env {a['env_id']})"
    if index >= min(len(a["messages"] or []), len(b["messages"] or [])):
        return f"{where}: the episode ended at another turn after the same {done} answers"
    if done == 0:
        return f"{where}: the reset of that seed gave another observation"
    return f"{where}: turn {done}'s answer, the same as stored, got another observation or reward"


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
