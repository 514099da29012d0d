"""What a run shows in Prefect beyond its logs: artifact keys, and docs/runs.md's automation reacting to an
Echo-Trap event on a real Prefect server (the training flow's own artifacts and events are checked on
real runs in tests/flows/test_train.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from flows.reporting import ECHO_TRAP_EVENT, artifact_key

#: a real Prefect server (started once per test process): `make test` runs it, `make test-fast` does not
pytestmark = pytest.mark.slow

RUNS_DOC = Path(__file__).resolve().parents[2] / "docs" / "runs.md"


def test_artifact_keys_are_what_prefect_accepts() -> None:
    assert artifact_key("mlflow", "Bandit_Tiny.v2-691cb3ea") == "mlflow-bandit-tiny-v2-691cb3ea"
    assert re.fullmatch(r"[a-z0-9-]+", artifact_key("report", "filter ratio/0.25")), (
        "lowercase, digits, dashes"
    )


def test_the_documented_automation_cancels_the_flow_run_an_echo_trap_event_is_related_to(
    prefect_server: str,
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Running

    code = re.search(r"### What a run shows in Prefect.*?```python\n(.*?)```", RUNS_DOC.read_text(), re.S)
    assert code, "docs/runs.md: no automation example"

    @flow(name="echo-trap-victim")
    def victim() -> None:
        pass

    with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        namespace: dict = {}
        exec(code.group(1), namespace)  # the documented code itself creates the automation
        from prefect.automations import Automation

        automation = Automation.read(name="ragen-cancel-on-echo-trap")
        try:
            with get_client(sync_client=True) as client:
                run = client.create_flow_run(victim, name="train/victim-run")
                client.set_flow_run_state(run.id, Running(), force=True)
                # The server starts matching the new automation after it reloads them (a few seconds).
                deadline, state = time.monotonic() + 60, None
                while time.monotonic() < deadline:
                    emit_event(
                        event=f"{ECHO_TRAP_EVENT}.entropy-collapse",
                        resource={"prefect.resource.id": "ragen.run.victim-run"},
                        related=[
                            {
                                "prefect.resource.id": f"prefect.flow-run.{run.id}",
                                "prefect.resource.role": "flow-run",
                            }
                        ],
                        payload={"iteration": 2},
                    )
                    EventsWorker.drain_all()
                    time.sleep(3)
                    state = client.read_flow_run(run.id).state
                    if state is not None and state.type.value in ("CANCELLING", "CANCELLED"):
                        break
                assert state is not None and state.type.value in ("CANCELLING", "CANCELLED"), state
        finally:
            automation.delete()


def test_a_training_flow_run_is_tagged_with_its_envs_algorithm_and_sweep() -> None:
    from flows.reporting import train_tags
    from ragen_core.config import load_config

    cfg = load_config(
        RUNS_DOC.parents[1] / "configs" / "bandit-tiny.yaml",
        ["val.tags=[Bandit,BanditTest]", "val.n_groups=[4,4]"],
    )
    assert train_tags(cfg, {}) == ["ragen", "env:Bandit", "env:BanditTest", "adv_estimator:gae"]
    member = train_tags(cfg, {"sweep": "ux-mini", "sweep_member": "no-filter-s0"})
    assert member[-2:] == ["sweep:ux-mini", "sweep-member:no-filter-s0"]


def test_the_run_summary_shows_success_per_tag_at_the_first_best_and_last_steps(tmp_path: Path) -> None:
    import json

    from ragen_core.config import load_config
    from ragen_core.run.run_dir import RunDir, atomic_write_text
    from ragen_core.run.training import run_summary_markdown

    cfg = load_config(
        RUNS_DOC.parents[1] / "configs" / "bandit-tiny.yaml",
        ["val.tags=[Bandit,BanditTest]", "val.n_groups=[4,4]"],
    )
    run = RunDir(tmp_path / "bandit-tiny-0123abcd-ef4567")
    for step, (a, b) in {0: (0.25, 0.5), 5: (0.75, 0.25), 10: (0.5, 0.125)}.items():
        values = {
            "val-env/success": (a + b) / 2,
            "val-env/Bandit/success": a,
            "val-env/BanditTest/success": b,
        }
        atomic_write_text(run.eval_metrics_file(step), json.dumps(values))
    result = {
        "run_id": run.root.name,
        "run_dir": str(run.root),
        "last_iteration": 10,
        "best_step": run.best_step(10),
        "mlflow_run_id": "abc123",
        "mlflow_url": "http://127.0.0.1:5000/#/experiments/1/runs/abc123",
        "models": {"final": f"models:/{run.root.name}@final"},
    }
    text = run_summary_markdown(cfg, run, result)
    assert "best step **5**" in text
    assert "| validation success | step 0 (first) | step 5 (best) | step 10 (last) |" in text
    assert "| Bandit | 0.250 | 0.750 | 0.500 |" in text
    assert "| BanditTest (held out) | 0.500 | 0.250 | 0.125 |" in text
    assert f"`{run.root}`" in text and "[abc123](http://127.0.0.1:5000/" in text
    assert f"models:/{run.root.name}@final" in text
    never = run_summary_markdown(cfg, RunDir(tmp_path / "other"), {**result, "best_step": None})
    assert "never validated" in never and "| validation success |" not in never
