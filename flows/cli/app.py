"""The ``ragen`` typer app: the global options, and every command group's module registered in the
order ``ragen --help`` lists them."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from flows.cli.common import CONTEXT_SETTINGS, RagenGroup, package_version
from flows.cli.demo import demo
from flows.cli.doctor import doctor
from flows.cli.env import env_app
from flows.cli.model import model_app
from flows.cli.pipeline import evaluate, rerun, train
from flows.cli.probe import probe
from flows.cli.show import show
from flows.cli.sweep import sweep_app
from flows.cli.ui import ui

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
    if debug:  # the environment carries it to the error wrapper and to Prefect's log filter
        os.environ["RAGEN_DEBUG"] = "1"


for command in (show, demo, train, probe, evaluate, rerun, ui, doctor):
    app.command()(command)
app.add_typer(sweep_app, name="sweep")
app.add_typer(model_app, name="model")
app.add_typer(env_app, name="env")
