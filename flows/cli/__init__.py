"""The ``ragen`` command line (``pyproject.toml``: ``ragen = "flows.cli:app"``), one module per
command group:

* ``pipeline``: ``train``, ``evaluate``, ``rerun`` (the flows of ``flows.train``, ``flows.evaluate``,
  ``flows.rerun``); ``probe``: go / no-go of a config's starting policy;
* ``show``: a run's, an iteration's or a file's trajectories (rendered by ``ragen_core.tracking.rendering``);
* ``sweep``: ``sweep plan|run|report``; ``model``: ``model import`` of GGUF files;
* ``ui``: the MLflow UI and a Prefect server on loopback, supervised together; ``doctor``: the install;
  ``demo``: oracle play through the agent protocol;
* ``common``: the error wrapper, the console, the error exit, the services' environment;
* ``app``: the typer app that registers them (``ragen --version``; ``-h`` is ``--help`` everywhere).

Every command imports what it needs inside its function, so ``ragen --help`` stays fast and one
command's heavy dependencies (torch, prefect, mlflow, ray) never slow down another. To add a
command, write its function in the module of its group (or a new module), keep its imports local,
and register it in ``app``. Errors need no handling in a command: :class:`common.RagenGroup` runs
every command and prints a user error (see ``ragen_core.errors``) as its one-line message, anything
else as one ``internal error`` line; ``ragen --debug`` (or ``RAGEN_DEBUG=1``) shows the traceback
instead.
"""

from __future__ import annotations

from flows.cli.app import app

__all__ = ["app"]
