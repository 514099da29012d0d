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

    # the default plays every tag this install can build (library tags need the envlibs extra)
    default = ",".join(t for t in envs.tags() if envs.registry.available(t))
    main(tags=tags or default, groups=groups, transcripts=transcripts)
