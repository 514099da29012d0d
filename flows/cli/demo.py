"""``ragen demo``: the oracle of every catalogue environment plays through the agent protocol."""

from __future__ import annotations

from typing import Annotated

import typer


def demo(
    tags: Annotated[str | None, typer.Option(help="Comma-separated catalogue tags (default: all).")] = None,
    groups: Annotated[int, typer.Option(min=1, help="Initial states (validation seeds) per tag.")] = 32,
    transcripts: Annotated[int, typer.Option(min=0, help="Transcripts printed per tag.")] = 1,
) -> None:
    """Play every catalogue environment with its oracle through the agent protocol (no model)."""
    import envs
    from flows.demo import main

    main(tags=tags or ",".join(envs.tags()), groups=groups, transcripts=transcripts)
