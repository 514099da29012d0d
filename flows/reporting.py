"""Where a user watching a run sees its progress: the line per iteration and the closing lines
(``ragen_core.progress`` writes them) go to the terminal and to the flow run's Prefect logs.

The CLI keeps Prefect's own INFO chatter off the terminal (``PREFECT_LOGGING_LEVEL=WARNING``, set by
``flows.settings``); these lines go through a child of the run logger whose own level is INFO. Python
logging hands a propagated record to every ancestor's handlers whatever the ancestors' levels, so
they reach Prefect's API handler (the flow run's logs in the UI) and the console handler alike.
"""

from __future__ import annotations

import logging

from prefect import get_run_logger


def progress_logger() -> logging.LoggerAdapter:
    """The current flow or task run's logger, one level below it and at INFO; outside a run (a flow's
    ``.fn`` called directly) the ``ragen.flows`` logger."""
    from prefect.exceptions import MissingContextError

    try:
        base = get_run_logger()
    except MissingContextError:
        return logging.LoggerAdapter(logging.getLogger("ragen.flows"), {})
    child = base.logger.getChild("ragen")
    child.setLevel(logging.INFO)
    return type(base)(child, base.extra)
