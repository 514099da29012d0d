"""What ``ragen train --resume RUN`` accepts besides the run: the policy for a config and overrides.

A resumed run keeps the config its stored iterations were made with; anything else would make the
run a mix of two experiments that no one can rerun. What is safe is accepted and recorded:

* ``trainer.iterations``: extend a run ("50 more iterations"), or end it earlier, but never before
  its last complete iteration;
* how the loop is orchestrated and observed, which changes no number: ``trainer.eval_every``,
  ``trainer.backend``, ``trainer.iteration_as`` and ``tracking.*``;
* ``trainer.learners`` (elastic resume): K data-parallel learners take the step one learner takes,
  from the same checkpoint (weights and optimiser state are whole on every rank), so only the
  all-reduce's float summation order differs. Each iteration records the learner count it ran
  with (its learn stage record), and ``ragen rerun`` of an iteration uses that count, so a stored
  iteration still reruns identical after the count changed.

Any other change, through ``--set`` or through a config file given with ``--resume``, is refused
before anything is written, naming the keys, their stored and given values, and the fix (a new run).
An accepted change rewrites ``config.yaml`` and is appended to ``run.json``'s ``resumes`` list.

``run.json`` keeps the config's ``config_hash`` and its keys (``config_keys``) as ragen last wrote it,
so a ``config.yaml`` edited by hand (its ``SHA256SUMS`` recomputed too) is refused on resume, naming
the keys that differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ragen_core.config import RagenConfig, config_hash, flatten, load_config
from ragen_core.errors import RagenError

#: Keys a resume may change (exact keys, or prefixes ending in a dot).
RESUMABLE = (
    "trainer.iterations",
    "trainer.eval_every",
    "trainer.backend",
    "trainer.iteration_as",
    "trainer.learners",
    "trainer.actor_loss_retries",
    "trainer.keep_optimizer_states",  # what is kept on disk, not what an iteration computes
    "trainer.keep_policies",
    "learner.placement",
    "tracking.",
)


class ResumeError(RagenError, ValueError):
    """A resume asked to change what the run's stored iterations depend on."""


def _allowed(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE)


def resume_config(
    run_root: Path,
    stored: RagenConfig,
    last_complete: int,
    config: str | Path | None = None,
    overrides: Iterable[str] = (),
) -> tuple[RagenConfig, dict[str, tuple[str, str]]]:
    """The config to resume with, and the changes made to the stored one (``{key: (stored, new)}``).

    ``config`` (a YAML file) and ``overrides`` are applied as for a new run; the result may differ
    from ``stored`` only in :data:`RESUMABLE` keys, else :class:`ResumeError`.
    """
    check_config_unchanged(run_root, stored)
    overrides = list(overrides)
    if config is None and not overrides:
        return stored, {}
    if config is None:  # the run's own config.yaml, maybe written by an earlier version
        given = load_config(run_root / "config.yaml", overrides, stored=True)
    else:
        given = load_config(config, overrides)
    old, new = flatten(stored), flatten(given)
    changes = {
        k: (old.get(k, "-"), new.get(k, "-")) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
    }
    refused = [k for k in changes if not _allowed(k)]
    if refused:
        shown = "; ".join(f"{k}: stored {changes[k][0]}, given {changes[k][1]}" for k in refused[:5])
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        source = f"config {config}" if config is not None else "--set"
        raise ResumeError(
            f"cannot resume {run_root.name} with {source}: it changes {shown}{more}. A resumed run keeps the "
            f"config of its stored iterations (only {', '.join(RESUMABLE)}* may change); resume without it, "
            "or start a new run with this config"
        )
    if given.trainer.iterations < last_complete:
        raise ResumeError(
            f"cannot resume {run_root.name} with trainer.iterations={given.trainer.iterations}: it already has "
            f"{last_complete} complete iterations; give trainer.iterations >= {last_complete}"
        )
    return given, changes


def check_config_unchanged(run_root: Path, stored: RagenConfig) -> None:
    """:class:`ResumeError` when ``config.yaml`` (read as ``stored``) is not the config ragen recorded
    in ``run.json``: the keys that differ, and the fix. A run made before the keys were recorded is
    not checked (a key added to the schema since then changes the hash without any edit)."""
    try:
        info = json.loads((run_root / "run.json").read_text())
    except (OSError, ValueError):
        return  # reading run.json is the run directory's own check, with its own message
    recorded, keys = info.get("config_hash"), info.get("config_keys")
    if not recorded or not isinstance(keys, dict) or config_hash(stored) == recorded:
        return
    now = flatten(stored)
    differ = [k for k in sorted(keys) if now.get(k, "-") != keys[k]]
    if not differ:
        return
    shown = "; ".join(f"{k}: recorded {keys[k]}, config.yaml {now.get(k, '-')}" for k in differ[:5])
    more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
    raise ResumeError(
        f"cannot resume {run_root.name}: its config.yaml was edited after the run started ({shown}{more}; "
        f"config_hash {recorded} in run.json, {config_hash(stored)} now). A resumed run keeps the config of "
        "its stored iterations: restore config.yaml, or start a new run with the edited config; only "
        f"{', '.join(RESUMABLE)}* may change, with `ragen train --resume RUN --set KEY=VALUE`"
    )
