"""``ragen show``: a run's, an iteration's or a file's trajectories as readable transcripts and a
summary per env tag (the rendering is ``ragen_core.tracking.rendering``'s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import console, fail
from ragen_core.errors import RagenError  # light (standard library only): --help stays fast

if TYPE_CHECKING:
    from rich.console import Console

    from ragen_core.trajectory import Trajectory


class ShowError(RagenError):
    """A ``ragen show`` target that names no trajectories; the message says what to pass instead."""


def _iteration_folder(root: Path, name: str) -> Path | None:
    """``root/iter_KKKK`` for ``name`` ``iter_K`` (any zero padding), else None."""
    digits = name.removeprefix("iter_")
    return root / f"iter_{int(digits):04d}" if name.startswith("iter_") and digits.isdigit() else None


def _last_rollouts(run_root: Path) -> Path:
    """The rollouts of the run's last iteration that has any (a running run's newest one too)."""
    found = sorted(p for p in run_root.glob("iter_*/rollouts.parquet") if p.parent.name[5:].isdigit())
    if not found:
        raise ShowError(
            f"run {run_root.name} ({run_root}) has no rollouts yet: no iter_K/rollouts.parquet in it; "
            f"its validations are under {run_root / 'eval'} (pass one of those .parquet files)"
        )
    return max(found, key=lambda p: int(p.parent.name[5:]))


def _in_iteration(folder: Path) -> Path:
    if (folder / "rollouts.parquet").is_file():
        return folder / "rollouts.parquet"
    have = sorted(p.parent.name for p in folder.parent.glob("iter_*/rollouts.parquet"))
    raise ShowError(
        f"{folder}: no rollouts.parquet there; iterations with rollouts: {', '.join(have) or 'none'}"
    )


def trajectory_source(target: str) -> Path:
    """The trajectory file ``ragen show TARGET`` reads: a .parquet file; an iteration folder (its path,
    or ``RUN/iter_K`` with a run id); a run (id or directory: its last iteration's rollouts)."""
    from ragen_core.state_folder import locate_run

    path = Path(target).expanduser()
    if path.is_file():
        return path
    if path.is_dir() and not (path / "config.yaml").is_file():
        if (path / "rollouts.parquet").is_file() or path.name.startswith("iter_"):
            return _in_iteration(path)
        raise ShowError(
            f"{path}: a folder with neither rollouts.parquet (an iteration folder) nor config.yaml (a run "
            "directory); pass a .parquet file, a run id, RUN/iter_K, or an iteration folder"
        )
    run = locate_run(target)  # light: no torch (ragen_core.state_folder)
    if run is not None:
        return _last_rollouts(run)
    run = locate_run(str(Path(target).parent)) if Path(target).parent != Path(".") else None
    folder = _iteration_folder(run, Path(target).name) if run is not None else None
    if folder is not None:
        return _in_iteration(folder)
    raise ShowError(
        f"{target}: no such trajectory file, iteration folder or run; pass a .parquet file, a run id or "
        "run directory (its last iteration), RUN/iter_K (e.g. RUN/iter_0002), or an iteration folder"
    )


def filter_decisions(rollouts: Path, n: int) -> list[bool] | None:
    """Per row of ``rollouts``: whether the StarPO-S filter kept its group, read from the
    ``filter.json`` beside it (an iteration's); None where there is none (validation files, a copy)."""
    from ragen_core.filter_record import kept_rows_of

    file = rollouts.with_name("filter.json")
    if rollouts.name != "rollouts.parquet" or not file.is_file():
        return None
    try:
        kept = set(kept_rows_of(json.loads(file.read_text())))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShowError(
            f"{file}: cannot read the filter's decisions ({type(exc).__name__}: {exc}); "
            f"`ragen rerun RUN --iteration K --stage rollout` recomputes the iteration"
        ) from exc
    return [i in kept for i in range(n)]


def _read(path: Path) -> list[Trajectory]:
    from ragen_core.trajectory import TrajectoryFileError, read_trajectories

    try:
        return read_trajectories(path)
    except TrajectoryFileError as exc:
        fail(str(exc))
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
        fail(f"{path}: cannot read trajectories: {exc}")


def _select(
    path: Path, trajs: list[Trajectory], row: int | None, env: str | None, failed: bool
) -> list[tuple[int, Trajectory]]:
    """The (row number, trajectory) pairs that pass ``--row``, ``--env`` and ``--failed``."""
    indexed = list(enumerate(trajs))
    if row is not None:
        if not 0 <= row < len(trajs):
            fail(f"{path}: --row {row} is out of range; the file has {len(trajs)} rows (0-{len(trajs) - 1})")
        indexed = [indexed[row]]
    if env is not None:
        tags = sorted({t.env_tag for t in trajs})
        if env not in tags:
            fail(
                f"{path}: no trajectories with env tag {env!r}; tags in this file: {', '.join(tags) or 'none'}"
            )
        indexed = [(i, t) for i, t in indexed if t.env_tag == env]
    if failed:
        indexed = [(i, t) for i, t in indexed if not t.success]
    return indexed


def _print_header(
    out: Console, path: Path, target: str, indexed: list[tuple[int, Trajectory]], kept: list[bool] | None
) -> None:
    """Which file (when the target was not one), what success means on each tag, what the filter kept."""
    from rich.text import Text

    from ragen_core.tracking.rendering import success_lines

    if str(path) != target:
        out.print(Text(f"trajectories: {path}", style="dim"))
    for line in success_lines(list(dict.fromkeys(t.env_tag for _, t in indexed))):
        out.print(Text(line, style="dim"))
    if kept is not None:
        out.print(
            Text(
                f"filter: kept {sum(kept)} of {len(kept)} trajectories (whole groups; {path.with_name('filter.json')})",
                style="dim",
            )
        )


def show(
    target: Annotated[
        str,
        typer.Argument(
            help="A trajectory file (.parquet), a run id or run directory (its last iteration's rollouts), "
            "RUN/iter_K (e.g. RUN/iter_0002), or an iteration folder."
        ),
    ],
    row: Annotated[
        int | None, typer.Option("--row", "-r", help="Show only this row (0-based) of the file.")
    ] = None,
    failed: Annotated[bool, typer.Option("--failed", help="Only trajectories that did not succeed.")] = False,
    env: Annotated[str | None, typer.Option("--env", "-e", help="Only trajectories of this env tag.")] = None,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=0, help="Transcripts to print (0: summary only).")
    ] = 3,
) -> None:
    """Print readable transcripts of rollouts and a per-env-tag summary table.

    Each trajectory of an iteration is marked KEPT or DROPPED by the StarPO-S filter (from the
    iteration's filter.json), and a line per tag says what success means there. The summary covers
    every trajectory that passes --failed / --env (not only the printed ones). Format-penalty rate:
    the share of played turns charged a format penalty.
    """
    path = trajectory_source(target)  # before the trajectory module (torch) loads: a typo fails at once
    from rich.text import Text

    from ragen_core.run.stage_record import misplaced_file
    from ragen_core.tracking.rendering import print_transcript, summarize, summary_table

    misplaced = misplaced_file(path.resolve())  # another iteration's rows, shown as this one's: refuse
    if misplaced:
        raise ShowError(misplaced)

    trajs = _read(path)
    kept = filter_decisions(path, len(trajs))
    out = console()
    indexed = _select(path, trajs, row, env, failed)
    if not indexed:
        out.print(f"{path}: no trajectories match the filters ({len(trajs)} rows in the file)")
        return
    _print_header(out, path, target, indexed, kept)
    for i, t in indexed[:limit]:
        print_transcript(out, i, t, None if kept is None else kept[i])
    if len(indexed) > limit > 0:
        out.print(
            Text(f"... {len(indexed) - limit} more matching trajectories (use --limit or --row)", style="dim")
        )
    filters = [
        f
        for f, on in (("failed", failed), (f"env={env}", env is not None), (f"row={row}", row is not None))
        if on
    ]
    title = f"{path.name}: {len(indexed)} of {len(trajs)} trajectories" + (
        f" ({', '.join(filters)})" if filters else ""
    )
    shown_kept = None if kept is None else [kept[i] for i, _ in indexed]
    out.print(summary_table(summarize([t for _, t in indexed], shown_kept), title))
