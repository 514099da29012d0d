"""Prefect flows and the ``ragen`` CLI. Imports :mod:`ragen_core` first: it pins MKL's reproducible
mode, which has to happen before torch is loaded."""

import ragen_core  # noqa: F401
