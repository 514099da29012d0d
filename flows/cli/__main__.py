"""``python -m flows.cli``: the ``ragen`` command."""

from flows.cli import app

app()
