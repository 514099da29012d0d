"""``ragen sweep plan|run|report``: grids of training runs nested under one MLflow parent run
(``flows.sweep``), and their comparison report (``ragen_core.sweep.report``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import CONTEXT_SETTINGS, console, fail, prepare

if TYPE_CHECKING:
    from ragen_core.sweep.report import Report

sweep_app = typer.Typer(
    help="Sweeps: grids of training runs nested under one MLflow parent run, and their comparison report.",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=CONTEXT_SETTINGS,
)


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
            final, peak = g.final.get(k), g.peak.get(k)
            cells += [final.text() if final else "-", peak.text() if peak else "-"]
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
    state = prepare()
    from ragen_core.sweep.spec import SweepError, expand, load_sweep

    try:  # a broken sweep file fails before Prefect starts
        sweep = load_sweep(path)
        expand(sweep)
    except SweepError as exc:
        fail(str(exc))
    from ragen_core.sweep.state import SweepState, sweep_lock

    folder = SweepState.folder(state, sweep)
    if folder.is_dir():  # a run of this sweep in flight: say so now, not after Prefect has started
        sweep_lock(folder).acquire().release()
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
    """Regenerate a sweep's comparison report from MLflow alone (report.md, report.html, report.json, PNG curves); with --log, also onto the parent run (its
    files, description and metrics), as the sweep does."""
    state = prepare()
    from ragen_core.config.tracking import TrackingConfig
    from ragen_core.sweep.report import build_report, publish_report
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
    if log:  # as the sweep publishes it: files, the parent's description and metrics
        status = tracker.client.get_run(parent_run_id).info.status  # as the sweep left it
        tracker.start(f"sweep-{report.sweep}", {}, run_id=parent_run_id)
        try:
            publish_report(report, tracker, folder, log_artifacts=True)
        finally:
            tracker.end(status if status in ("FINISHED", "FAILED", "KILLED") else "FINISHED")
        paths = sorted(folder.iterdir())
    else:
        paths = report.write(folder, run_url=tracker.run_url)
    _print_report(report, paths)
