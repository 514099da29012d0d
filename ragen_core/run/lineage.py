"""What a run trained and was validated on, as MLflow sees lineage: the train and validation
environment groups as dataset inputs (contexts ``train`` and ``validation``), the SFT warm start's
loss curve, and the machine's system metrics while the run trains.

An environment group has no file: its "dataset" is the specification that generates its episodes
(tags, groups, group size, seeds, each tag's catalogue settings and overrides), and its digest is
that specification's hash, so two runs on the same episodes show the same dataset in the UI.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from ragen_core.config import RagenConfig
from ragen_core.env_groups import EnvGroupsConfig
from ragen_core.run.run_dir import RunDir
from ragen_core.tracking.tracker import Tracker

_log = logging.getLogger(__name__)

#: The MLflow dataset contexts of the two env group configs.
CONTEXTS = {"train": "train", "val": "validation"}
#: How often the system metrics are sampled (seconds): one point per sample, as MLflow's UI expects.
SYSTEM_METRICS_INTERVAL_S = 10.0


def env_dataset(groups: EnvGroupsConfig, mode: str, cfg: RagenConfig) -> dict[str, Any]:
    """The episodes a config's env groups generate, as a dataset description: ``name``, ``digest``
    (of ``profile``), ``source`` and ``profile`` (JSON)."""
    import envs

    n = sum(groups.n_groups)
    base = groups.base_seed(mode)  # type: ignore[arg-type]
    profile = {
        "tags": list(groups.tags),
        "n_groups": list(groups.n_groups),
        "group_size": groups.group_size,
        # train: iteration k plays seeds base + (k - 1) * n ... ; validation: always the first n
        "seeds": {"base": base, "per_iteration": n, "fixed": mode == "val"},
        "max_turn": cfg.agent.max_turn,
        "envs": {
            tag: {
                "env_type": (s := envs.spec(tag, **groups.env_overrides.get(tag, {}))).env_type,
                "max_actions_per_traj": s.max_actions_per_traj,
                "env_config": s.env_config,
                # a remote tag's episodes are the server's: the data is named by where it came from
                **({"remote": groups.remote[tag].url} if tag in groups.remote else {}),
            }
            for tag in dict.fromkeys(groups.tags)
        },
    }
    text = json.dumps(profile, sort_keys=True, default=str)
    return {
        "name": f"{CONTEXTS[mode]}: "
        + ", ".join(f"{t} x{g}" for t, g in zip(groups.tags, groups.n_groups, strict=True)),
        "digest": hashlib.sha256(text.encode()).hexdigest()[:16],
        "source": "ragen-flow environments (generated from seeds)",
        "profile": text,
    }


def _duplicate_row(exc: BaseException) -> bool:
    """A unique-key violation in the store (SQLite, PostgreSQL, MySQL wording)."""
    text = f"{exc} {exc.__cause__ or ''}"
    return any(s in text for s in ("UNIQUE constraint failed", "duplicate key value", "Duplicate entry"))


def log_inputs(tracker: Tracker, run_id: str, inputs: list[Any]) -> None:
    """``log_inputs``, once more after a duplicate-row error. MLflow looks a dataset up and inserts it
    if absent in two steps; two runs logging the same env groups at the same moment (the members of
    a sweep, which share their env specs, hence their digests) can both miss it, and the second insert
    fails. On the retry the lookup finds the row the other run wrote."""
    try:
        tracker.client.log_inputs(run_id, datasets=inputs)
    except Exception as e:
        if not _duplicate_row(e):
            raise
        time.sleep(0.2)
        tracker.client.log_inputs(run_id, datasets=inputs)


def log_lineage(tracker: Tracker, cfg: RagenConfig, run: RunDir) -> None:
    """Log the env groups as dataset inputs and the warm start's loss curve, once per run (a resumed
    run has them; ``run.json`` ``logged_artifacts`` records it)."""
    run_id = tracker.run_id
    if run_id is None or tracker.offline is not None:
        return
    done = run.info().get("logged_artifacts", [])
    if "lineage" in done:
        return
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric

    try:
        inputs = []
        for mode, groups in (("train", cfg.train), ("val", cfg.val)):
            d = env_dataset(groups, mode, cfg)
            dataset = Dataset(d["name"], d["digest"], "code", d["source"], profile=d["profile"])
            inputs.append(DatasetInput(dataset, [InputTag("mlflow.data.context", CONTEXTS[mode])]))
        log_inputs(tracker, run_id, inputs)
        sft = run.init_policy / "sft_metrics.json"
        if sft.is_file():
            curve = json.loads(sft.read_text()).get("loss_curve", [])
            timestamp = int(sft.stat().st_mtime * 1000)
            metrics = [Metric("sft/loss", float(loss), timestamp, int(step)) for step, loss in curve]
            for i in range(0, len(metrics), 1000):  # MLflow's batch limit
                tracker.client.log_batch(run_id, metrics=metrics[i : i + 1000])
    except Exception as e:
        tracker.go_offline(f"log the datasets and warm start of run {run_id}", e)
        return
    run.update_info(logged_artifacts=[*done, "lineage"])


class SystemMetrics:
    """MLflow's system metrics (``system/cpu_utilization_percentage``, memory, disk, network, and
    GPU where there is one) for the tracker's run, from ``start`` to ``stop``."""

    def __init__(self, tracker: Tracker, enabled: bool = True) -> None:
        self.monitor: Any = None
        self.tracker = tracker
        if not enabled or tracker.run_id is None or tracker.offline is not None:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop chatter
        # mlflow leaves SystemMetricsMonitor.__init__ unannotated
        self.monitor = SystemMetricsMonitor(  # type: ignore[no-untyped-call]
            tracker.run_id,
            sampling_interval=SYSTEM_METRICS_INTERVAL_S,
            resume_logging=True,  # a resumed run continues its system metrics' steps
            tracking_uri=tracker.tracking_uri,
        )

    def start(self) -> SystemMetrics:
        if self.monitor is not None:
            self.monitor.start()
        return self

    def stop(self) -> None:
        """Stop sampling, take a last sample (a run shorter than the interval still gets one) and send
        what is pending, before the run ends."""
        if self.monitor is None:
            return
        monitor, self.monitor = self.monitor, None
        if self.tracker.offline is not None:  # the store is down: no retry sequence for a courtesy metric
            monitor.mlflow_logger.data = []  # what finish() would flush
            monitor.finish()
            return
        monitor.finish()  # joins the sampling thread: the last sample below is this thread's alone
        try:
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as e:  # a courtesy metric: never fail a finished run over it
            _log.warning("could not send the last system metrics sample: %s", e)
