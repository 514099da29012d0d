"""Sweeps: a grid of training runs (the paper's ablations), split by what each part is for.

- ``ragen_core.sweep.spec``: the sweep file and its expansion into members (``load_sweep``, ``expand``,
  ``validate_members``, ``sweep_hash``);
- ``ragen_core.sweep.state``: what a running sweep remembers between runs (``SweepState``, ``state.json``);
- ``ragen_core.sweep.tags``: the MLflow tags of a sweep's runs (written by the sweep flow, read by the
  report);
- ``ragen_core.sweep.report``: the comparison report, built from MLflow alone.

Import names from the module that defines them; this package re-exports nothing, so each importer
shows which part of a sweep it depends on.
"""
