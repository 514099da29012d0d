"""``ragen env serve``: a registered environment as an OpenEnv server (docs/environments.md,
"Environments over the wire")."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from flows.cli.common import CONTEXT_SETTINGS, console, fail

env_app = typer.Typer(
    help="Environments over the wire: serve a registered environment with the OpenEnv protocol.",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=CONTEXT_SETTINGS,
)


@env_app.command("serve")
def env_serve(
    tag: Annotated[
        str, typer.Argument(help="An environment tag of envs/catalogue.yaml or a plug-in, e.g. FrozenLake.")
    ],
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    host: Annotated[
        str,
        typer.Option(help="Address to listen on; anything but loopback needs --token-env."),
    ] = "127.0.0.1",
    token_env: Annotated[
        str | None,
        typer.Option(
            "--token-env",
            help="Name of an environment variable holding the token clients must send "
            "(Authorization: Bearer TOKEN); required off loopback.",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="A setting of the environment, KEY=VALUE (YAML), e.g. is_slippery=false."),
    ] = None,
    max_sessions: Annotated[int, typer.Option(help="Concurrent sessions (one per WebSocket).")] = 1024,
    max_steps: Annotated[int, typer.Option(help="Steps of one episode of a session.")] = 10_000,
    max_observation_bytes: Annotated[int, typer.Option(help="Bytes of one observation message.")] = 1_000_000,
    idle_timeout: Annotated[float, typer.Option(help="Seconds a session may stay idle.")] = 600.0,
) -> None:
    """Serve TAG as an OpenEnv server: /ws sessions, /reset, /step, /state, /health, /schema.

    A config plays it with train.remote (or val.remote): {TAG: {url: ws://HOST:PORT}}.
    """
    from envs.wire.server import ServeLimits, check_bind, serve
    from ragen_core.config import parse_overrides

    token = None
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            fail(
                f"--token-env {token_env}: that environment variable is not set or empty; export the token in it"
            )
    try:
        check_bind(host, token)
    except ValueError as exc:
        fail(str(exc))
    limits = ServeLimits(
        max_sessions=max_sessions,
        max_episode_steps=max_steps,
        max_observation_bytes=max_observation_bytes,
        idle_timeout_s=idle_timeout,
    )
    overrides = parse_overrides(set_ or [])
    console().print(
        f"serving {tag} on ws://{host}:{port}/ws (OpenEnv protocol); Ctrl-C stops it", markup=False
    )
    serve(tag, host=host, port=port, overrides=overrides, limits=limits, token=token)
