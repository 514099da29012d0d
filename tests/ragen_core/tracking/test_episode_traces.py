"""Episodes as MLflow traces, against a real local store (sqlite + artifact folder in tmp_path): the
hook in ``StepLogger.log_step`` logs a sample of the train rollouts and every final validation episode,
``mlflow.search_traces`` finds them by iteration, tag and success, the turn spans hold the Parquet's
exact text, and the feedback equals the Parquet's scores and the filter's decision."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pyarrow as pa
import pytest
from mlflow.tracing.client import TracingClient
from mlflow.tracking._tracking_service.utils import _use_tracking_uri

from ragen_core.config import RagenConfig, load_config
from ragen_core.run.run_dir import RunDir, create_run
from ragen_core.run.stages import filter_stage
from ragen_core.tracking.episode_traces import (
    build_trace,
    choose_all,
    choose_train,
    group_stats,
    session_id,
    trace_id_for,
    turns_of,
)
from ragen_core.tracking.tracker import Tracker
from ragen_core.trajectory import Trajectory, read_table, write_trajectories

TAGS = ("Bandit", "SimpleSokoban")
ITERATIONS = 2


def episode(tag: str, split: str, k: int, group: int, env_id: int, turns: int, success: bool) -> Trajectory:
    """A trajectory whose messages hold the characters a transcript can break on (newlines, quotes,
    backslashes, non-ASCII), with one assistant and one user message per turn."""
    messages = [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": f'Turn 1:\nState:\n#_P\n"{tag}" ünï √ \\n {env_id}\n'},
    ]
    rewards, penalties, infos, actions = [], [], [], []
    for t in range(turns):
        messages.append(
            {
                "role": "assistant",
                "content": f"<think>turn {t} of {env_id}\n</think><answer>Up || Left</answer>",
            }
        )
        if t < turns - 1:
            messages.append(
                {"role": "user", "content": f"Reward:\n-0.1\nTurn {t + 2}:\nState:\n_#P {env_id}\n"}
            )
        rewards.append(1.0 if success and t == turns - 1 else -0.1 * (env_id % 3))
        penalties.append(-0.1 if t == 0 and env_id % 2 else 0.0)
        infos.append({"action_is_valid": True, "action_is_effective": t % 2 == 0, "success": success})
        actions.append(["Up", "Left"] if t % 2 == 0 else [])
    reward, penalty = sum(rewards), sum(penalties)
    return Trajectory(
        run_id="traces-run",
        iteration=k,
        split=split,
        env_tag=tag,
        group_id=group,
        env_id=env_id,
        seed=1000 + group,
        turn_count=turns,
        success=success,
        truncated=not success,
        reward=reward,
        format_penalty=penalty,
        score=reward + penalty,
        input_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        turn_index=[0, 0, 0],
        rollout_logprobs=[0.0, -0.5, -0.5],
        messages=messages,
        actions=actions,
        turn_rewards=rewards,
        info={"end_reason": "done" if success else "max_turn", "turn_penalties": penalties, "infos": infos},
    )


def rollouts(k: int, split: str = "train", groups: int = 3, size: int = 2) -> list[Trajectory]:
    """Per tag ``groups`` groups of ``size`` members (group ids run on across tags, as in a rollout)."""
    out, env_id = [], 0
    for t, tag in enumerate(TAGS):
        for g in range(groups):
            for _ in range(size):
                out.append(
                    episode(
                        tag, split, k, t * groups + g, env_id, 1 + env_id % 3, (env_id * (g + 1)) % 3 == 0
                    )
                )
                env_id += 1
    return out


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, state: Path) -> Iterator[Path]:
    """The module's state folder (one MLflow store), with nothing landing in the working directory."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_STATE_DIR", str(state))
    monkeypatch.chdir(tmp_path)
    yield state


def config(tmp_path: Path, *overrides: str) -> RagenConfig:
    return load_config(
        overrides=[
            f"trainer.run_root={tmp_path / 'runs'}",
            f"trainer.iterations={ITERATIONS}",
            "rollout.filter.value=0.5",
            "tracking.background=false",
            *overrides,
        ]
    )


def stored_run(cfg: RagenConfig, name: str) -> RunDir:
    """A run directory with ITERATIONS iterations of rollouts (filtered by the real filter stage) and
    the final evaluation."""
    run = create_run(cfg, name)
    for k in range(1, ITERATIONS + 1):
        write_trajectories(rollouts(k), run.rollouts(k))
        filter_stage(cfg, run, k)
    write_trajectories(rollouts(ITERATIONS, "val", groups=4, size=1), run.eval_file(ITERATIONS))
    return run


def log_steps(run: RunDir, cfg: RagenConfig, state: Path, mlflow_run_id: str | None = None) -> Tracker:
    """Log every step of ``run`` through ``StepLogger.log_step`` (the hook under test)."""
    from ragen_core.run.step_log import StepLogger

    tracker = Tracker(cfg.tracking, state)
    with tracker:  # ends the MLflow run FINISHED
        run_id = tracker.start(run.info()["run_id"], {}, run_id=mlflow_run_id)
        run.update_info(mlflow_run_id=run_id)
        logger = StepLogger(tracker, run, run.info()["run_id"], cfg.trainer.iterations)
        for k in range(1, ITERATIONS + 1):
            logger.log_step(k, {"a": float(k)})
    return tracker


def search(uri: str, experiment_id: str, filter_string: str | None = None, **kw: Any) -> list[Any]:
    """``mlflow.search_traces`` on the store ``uri`` (the fluent API reads the global tracking URI)."""
    with _use_tracking_uri(uri):
        found: list[Any] = mlflow.search_traces(
            locations=[experiment_id], filter_string=filter_string, return_type="list", **kw
        )
    return found


def rows_by_env(path: Path) -> dict[int, dict[str, Any]]:
    return {r["env_id"]: r for r in read_table(path).to_pylist()}


def test_the_sample_keeps_the_filters_groups_first_and_every_tag() -> None:
    table = read_table_of(rollouts(1))
    scores = table.column("score").to_pylist()
    kept = [i for i, g in enumerate(table.column("group_id").to_pylist()) if g in (1, 4)]
    groups = group_stats(table, kept)
    assert {g for g, s in groups.items() if s.kept} == {1, 4}
    assert groups[2].score_std == pytest.approx(statistics.stdev(scores[4:6]))
    chosen = choose_train(table, 2, 64, groups)
    assert chosen == kept  # both members of the kept group of each tag, side by side
    assert choose_train(table, 1, 1, groups) == [kept[0]] and choose_train(table, 0, 64, groups) == []
    # validation: every row; a cap takes the tags in turn, so each stays represented
    assert choose_all(table, 100) == list(range(table.num_rows))
    assert choose_all(table, 3) == [0, 1, 6] and choose_all(table, 0) == []


def read_table_of(trajs: list[Trajectory]) -> pa.Table:
    from ragen_core.trajectory import to_table

    return to_table(trajs)


def test_turns_align_with_the_conversation_also_under_a_context_window() -> None:
    row = read_table_of([episode("SimpleSokoban", "train", 1, 0, 2, 3, True)]).to_pylist()[0]
    turns = turns_of(row)
    m = row["messages"]
    assert [t.prompt for t in turns] == [m[:2], m[:4], m[:6]]
    assert [t.response for t in turns] == [m[2]["content"], m[4]["content"], m[6]["content"]]
    assert [t.env_reply for t in turns] == [m[3]["content"], m[5]["content"], None]
    assert [t.actions for t in turns] == row["actions"] and [t.reward for t in turns] == row["turn_rewards"]
    # a window of 2 kept only turns 2 and 3, numbered from turn 2: only the last prompt is the model's
    windowed = dict(row, messages=[m[0], {"role": "user", "content": "Turn 1 (window)"}, *m[4:]])
    windowed["info"] = row["info"].replace('"end_reason"', '"first_trained_turn": 1, "end_reason"')
    turns = turns_of(windowed)
    assert [t.prompt is None for t in turns] == [True, True, False]
    assert [t.response for t in turns] == [None, m[4]["content"], m[6]["content"]]
    assert turns[1].env_reply == m[5]["content"] and turns[2].prompt == windowed["messages"][:4]
    # the step is the caller's: a schema v1 file numbered its iteration column differently
    info, spans = build_trace(
        dict(row, iteration=0), step=3, experiment_id="0", mlflow_run_id="r", start_ms=0
    )
    assert info.trace_metadata["ragen.iteration"] == "3" and info.trace_id == trace_id_for("r", "train", 3, 2)
    assert info.trace_metadata["mlflow.trace.session"].endswith("/train/iter_0003/group_0")
    assert [s.name for s in spans] == ["episode SimpleSokoban #2", "turn 1", "turn 2", "turn 3"]


def test_nul_bytes_of_model_text_are_escaped_in_the_previews_postgresql_stores() -> None:
    """PostgreSQL's text columns refuse NUL: MLflow's server on it rejected a batch of traces for one."""
    row = read_table_of([episode("SimpleSokoban", "train", 1, 0, 2, 1, True)]).to_pylist()[0]
    row["messages"][1]["content"] += "\x00state"
    row["messages"][2]["content"] = "<answer>Up\x00</answer>"
    info, spans = build_trace(row, step=1, experiment_id="0", mlflow_run_id="r", start_ms=0)
    assert "\x00" not in info.request_preview + info.response_preview  # type: ignore[operator]
    assert "\\0state" in info.request_preview and info.response_preview == "<answer>Up\\0</answer>"  # type: ignore[operator]
    assert all("\x00" not in v for s in spans for v in s.to_dict()["attributes"].values())


def test_training_logs_episodes_as_traces_that_search_finds(store: Path, tmp_path: Path) -> None:
    cfg = config(tmp_path, "tracking.experiment=traces", "tracking.max_traces_per_step=6")
    run = stored_run(cfg, "traces")
    tracker = log_steps(run, cfg, store)
    uri, exp, mlflow_run = tracker.tracking_uri, tracker.experiment_id, run.info()["mlflow_run_id"]
    assert exp is not None

    # the run's Traces tab: 2 per tag and iteration, plus the final evaluation's 8 episodes cut to 6
    assert len(search(uri, exp, run_id=mlflow_run)) == ITERATIONS * 2 * len(TAGS) + 6
    for k in range(1, ITERATIONS + 1):
        kept = set(run.read_json(run.filter_file(k))["kept_rows"])
        table = read_table(run.rollouts(k))
        rows = table.to_pylist()
        groups = {g: [r["score"] for r in rows if r["group_id"] == g] for g in {r["group_id"] for r in rows}}
        found = search(uri, exp, f"metadata.`ragen.iteration` = '{k}' AND metadata.`ragen.split` = 'train'")
        assert len(found) == 2 * len(TAGS)
        for tag in TAGS:
            of_tag = search(
                uri,
                exp,
                f"metadata.`ragen.iteration` = '{k}' AND metadata.`ragen.env_tag` = '{tag}' "
                "AND metadata.`ragen.split` = 'train'",
            )
            assert {t.info.trace_metadata["ragen.env_tag"] for t in of_tag} == {tag} and len(of_tag) == 2
            # a group the filter kept, both members: one session
            assert len({t.info.trace_metadata["mlflow.trace.session"] for t in of_tag}) == 1
        for trace in found:
            meta = trace.info.trace_metadata
            row = rows[next(i for i, r in enumerate(rows) if r["env_id"] == int(meta["ragen.env_id"]))]
            index = rows.index(row)
            assert meta["mlflow.sourceRun"] == mlflow_run and meta["ragen.run_id"] == "traces-run"
            assert meta["ragen.seed"] == str(row["seed"]) and meta["ragen.group_id"] == str(row["group_id"])
            assert meta["mlflow.trace.session"] == session_id(row, k)
            assert trace.info.trace_id == trace_id_for(mlflow_run, "train", k, row["env_id"])
            feedback = {a.name: a.value for a in trace.info.assessments}
            assert feedback["score"] == row["score"] and feedback["success"] is row["success"]
            assert feedback["filter_kept"] is (index in kept)
            assert feedback["group_reward_std"] == pytest.approx(statistics.stdev(groups[row["group_id"]]))
            check_spans(trace, row)

    # by success, across iterations and splits: exactly the Parquet's successful sampled episodes
    for success in (True, False):
        want = success_ids(run, mlflow_run, tracker, success)
        got = search(uri, exp, f"metadata.`ragen.success` = '{str(success).lower()}'")
        assert {t.info.trace_id for t in got} == want and want
        assert {
            t.info.trace_id for t in search(uri, exp, f"feedback.`success` = '{str(success).lower()}'")
        } == want

    # the final evaluation: tags in turn up to the cap, score and success, no filter feedback
    val = search(uri, exp, "metadata.`ragen.split` = 'val'")
    rows = rows_by_env(run.eval_file(ITERATIONS))
    assert sorted(int(t.info.trace_metadata["ragen.env_id"]) for t in val) == [0, 1, 2, 4, 5, 6]
    for trace in val:
        row = rows[int(trace.info.trace_metadata["ragen.env_id"])]
        assert trace.info.trace_metadata["ragen.iteration"] == str(ITERATIONS)
        assert {a.name: a.value for a in trace.info.assessments} == {
            "score": row["score"],
            "success": row["success"],
        }
        check_spans(trace, row)


def success_ids(run: RunDir, mlflow_run: str, tracker: Tracker, success: bool) -> set[str]:
    """The trace ids of the traced episodes (found by id: the tracker logged exactly those) that succeeded."""
    tracing = TracingClient(tracker.tracking_uri)
    out = set()
    files = [(run.rollouts(k), "train", k) for k in range(1, ITERATIONS + 1)]
    for path, split, k in [*files, (run.eval_file(ITERATIONS), "val", ITERATIONS)]:
        for row in read_table(path).to_pylist():
            trace_id = trace_id_for(mlflow_run, split, k, row["env_id"])
            try:
                tracing.get_trace_info(trace_id)
            except Exception:
                continue
            if row["success"] is success:
                out.add(trace_id)
    return out


def check_spans(trace: Any, row: dict[str, Any]) -> None:
    """A root span with the whole conversation and one chat span per turn, holding the Parquet's exact
    text: the prompt the model saw, what it wrote, and the environment's reply."""
    messages = row["messages"]
    root = next(s for s in trace.data.spans if s.parent_id is None)
    turns = sorted((s for s in trace.data.spans if s.parent_id is not None), key=lambda s: s.start_time_ns)
    assert root.span_type == "AGENT" and root.inputs == {"messages": messages[:-1]}
    assert root.outputs == messages[-1]["content"] and root.attributes["ragen.score"] == row["score"]
    assert len(turns) == row["turn_count"] == len(row["turn_rewards"])
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for t, (span, pos) in enumerate(zip(turns, assistant, strict=True)):
        assert span.span_type == "CHAT_MODEL" and span.name == f"turn {t + 1}"
        assert span.inputs == {"messages": messages[:pos]} and span.outputs == messages[pos]["content"]
        reply = messages[pos + 1]["content"] if pos + 1 < len(messages) else None
        assert span.attributes.get("ragen.env_reply") == reply
        assert span.attributes["ragen.actions"] == row["actions"][t]
        assert span.attributes["ragen.reward"] == row["turn_rewards"][t]
        assert span.attributes["ragen.action_is_effective"] is (t % 2 == 0)
    assert trace.info.request_preview == messages[1]["content"]


def test_a_resumed_run_adds_no_duplicates_and_a_failing_store_goes_offline(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path, "tracking.experiment=traces-resume")
    run = stored_run(cfg, "resume")
    tracker = log_steps(run, cfg, store)
    uri, exp, mlflow_run = tracker.tracking_uri, tracker.experiment_id, run.info()["mlflow_run_id"]
    assert exp is not None
    before = {t.info.trace_id: len(t.info.assessments) for t in search(uri, exp, run_id=mlflow_run)}
    assert len(before) == ITERATIONS * 2 * len(TAGS) + 8

    # a resume re-logs the steps its MLflow run lacks (here: all of them, as after a lost server)
    again = Tracker(cfg.tracking, store)
    again.start("resume", {}, run_id=mlflow_run)
    assert again.log_episode_traces(run.rollouts(1), 1, run.read_json(run.filter_file(1))["kept_rows"]) == 0
    assert again.log_episode_traces(run.eval_file(ITERATIONS), ITERATIONS) == 0
    after = {t.info.trace_id: len(t.info.assessments) for t in search(uri, exp, run_id=mlflow_run)}
    assert after == before

    def boom(*a: Any, **k: Any) -> None:
        raise ConnectionError("server went away")

    monkeypatch.setattr(TracingClient, "start_trace", boom)
    fresh = Tracker(cfg.tracking, store)
    fresh_run = fresh.start("flaky", {})
    assert fresh.log_episode_traces(run.rollouts(1), 1) == 0  # no raise: training goes on
    assert fresh.offline is not None and "log episode traces of rollouts.parquet" in fresh.offline
    assert fresh.log_iteration(1, {"a": 1.0}) is False  # offline: nothing else is tried
    fresh.end()
    again.end()
    assert search(uri, exp, run_id=fresh_run) == []


def test_rollouts_logged_before_the_step_are_not_logged_twice_and_a_resume_logs_the_step_whole(
    store: Path, tmp_path: Path
) -> None:
    """The flow logs an iteration's rollouts once the filter has judged them (``log_rollouts``) and
    its metrics at its end (``log_step``): the step gets each artifact and trace once; a process that
    died between the two leaves the step unmarked, and the resume's ``log_step`` adds what is missing
    without a second copy of the traces."""
    from mlflow.tracking import MlflowClient

    from ragen_core.run.step_log import StepLogger

    assert ITERATIONS == 2  # iteration 2 is the last, with the final evaluation
    cfg = config(tmp_path, "tracking.experiment=traces-early")
    run = stored_run(cfg, "early")
    tracker = Tracker(cfg.tracking, store)
    mlflow_run = tracker.start("early", {})
    uri, exp = tracker.tracking_uri, tracker.experiment_id
    assert exp is not None
    logger = StepLogger(tracker, run, "early", cfg.trainer.iterations)
    logger.log_rollouts(1)
    assert len(search(uri, exp, run_id=mlflow_run)) == 2 * len(TAGS)  # before the step's metrics
    logger.log_step(1, {"a": 1.0})
    logger.log_rollouts(2)  # the process dies before iteration 2's metrics
    assert len(search(uri, exp, run_id=mlflow_run)) == 2 * 2 * len(TAGS)
    tracker.end("KILLED")

    resumed = Tracker(cfg.tracking, store)
    resumed.start("early", {}, run_id=mlflow_run)
    assert resumed.logged_steps == {1}
    again = StepLogger(resumed, run, "early", cfg.trainer.iterations)
    for k in (1, 2):
        again.log_step(k, {"a": float(k)})
    resumed.end()
    assert resumed.logged_steps == {1, 2}
    # no duplicates: 2 per tag and iteration, and the final evaluation's 8 episodes (iteration 2)
    assert len(search(uri, exp, run_id=mlflow_run)) == ITERATIONS * 2 * len(TAGS) + 8
    client = MlflowClient(tracking_uri=uri)
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_run, "a")] == [(1, 1.0), (2, 2.0)]
    for k in (1, 2):
        files = {f.path for f in client.list_artifacts(mlflow_run, f"rollouts/iter_{k:04d}")}
        assert files == {f"rollouts/iter_{k:04d}/rollouts.parquet", f"rollouts/iter_{k:04d}/filter.json"}


@pytest.mark.parametrize(
    "overrides",
    [("tracking.traces_per_tag=0",), ("tracking.max_traces_per_step=0",), ("tracking.log_artifacts=false",)],
)
def test_traces_can_be_turned_off(store: Path, tmp_path: Path, overrides: tuple[str, ...]) -> None:
    cfg = config(tmp_path, "tracking.experiment=traces-off", *overrides)
    run = stored_run(cfg, "off")
    tracker = log_steps(run, cfg, store)
    assert tracker.experiment_id is not None
    found = search(tracker.tracking_uri, tracker.experiment_id, run_id=run.info()["mlflow_run_id"])
    # traces_per_tag=0 still traces the final evaluation; the other two trace nothing
    assert len(found) == (8 if overrides == ("tracking.traces_per_tag=0",) else 0)
