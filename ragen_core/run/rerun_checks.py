"""What ``ragen rerun`` checks before any work: the iteration is complete, the stage exists there, a
stored result to compare with exists and belongs to that iteration. Light (no torch, no Prefect), so
the CLI answers a rerun that cannot be done in about a second."""

from __future__ import annotations

from ragen_core.errors import RagenError
from ragen_core.run import stage_record
from ragen_core.run.run_dir import RunDir


class RerunError(RagenError):
    """A rerun that cannot be done (no such iteration or stage); the message says which exist."""


def check_rerun(run: RunDir, k: int, stage: str) -> None:
    """Raise :class:`RerunError` unless iteration ``k`` of ``run`` is stored with its ``stage``.

    Step 0 is the policy before training: it has an evaluation but no rollout or learner step.
    """
    last = run.last_complete()
    choose = f"use --iteration 1..{last}" if last else "the run has no complete iteration yet"
    if k == 0 and stage != "evaluate":
        raise RerunError(
            f"iteration 0 has no {stage} stage: iterations start at 1, and step 0 (the policy "
            f"before training) can only be evaluated (--stage evaluate); {choose}"
        )
    if k > last:
        raise RerunError(
            f"iteration {k} of run {run.root.name} is not complete (last complete: {last}); {choose}"
        )
    if stage == "evaluate" and not run.eval_file(k).exists():
        have = [
            int(p.stem[5:])
            for p in sorted((run.root / "eval").glob("step_*.parquet"))
            if p.stem[5:].isdigit()
        ]
        steps = f"steps with one: {', '.join(map(str, have))}" if have else "the run has no stored evaluation"
        raise RerunError(
            f"step {k} of run {run.root.name} has no stored evaluation to compare with ({run.eval_file(k)}); "
            f"{steps}; rerun one of them, or `ragen evaluate {run.root.name}@{k}` evaluates step {k} anew"
        )
    # a stored file swapped in from another iteration is named, not blamed on reproducibility
    misplaced = stage_record.misplaced_file(run.eval_file(k) if stage == "evaluate" else run.rollouts(k))
    if misplaced:
        raise RerunError(misplaced)
