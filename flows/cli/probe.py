"""``ragen probe``: before training, whether RL can learn from a config's starting policy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import console, prepare


def probe(
    config: Annotated[Path, typer.Argument(help="Run config (YAML) whose starting policy is checked.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (repeatable).")] = None,
    groups: Annotated[int, typer.Option(help="Groups of the train environments to play.", min=1)] = 4,
) -> None:
    """Check, before training, that RL can learn from the config's starting policy: go / no-go."""
    prepare()
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
