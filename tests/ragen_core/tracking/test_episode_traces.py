"""Episodes as MLflow traces, against a real local store (sqlite + artifact folder in tmp_path): the
hook in ``StepLogger.log_step`` logs a sample of the train rollouts and every final validation episode,
``mlflow.search_traces`` finds them by iteration, tag and success, the turn spans hold the Parquet's
exact text, and the feedback equals the Parquet's scores and the filter's decision."""

from __future__ import annotations

import dataclasses
import json
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
from ragen_core.filter_record import group_decisions, groups_of
from ragen_core.protocol import ProtocolConfig, TurnRecord, state_content
from ragen_core.run.run_dir import RunDir, create_run
from ragen_core.run.stages import filter_stage
from ragen_core.tracking.episode_traces import (
    build_trace,
    choose_all,
    choose_train,
    session_id,
    trace_id_for,
    turns_of,
)
from ragen_core.tracking.tracker import Tracker
from ragen_core.trajectory import Trajectory, read_table, write_trajectories

TAGS = ("Bandit", "SimpleSokoban")
ITERATIONS = 2
PER_TAG = 4  # tracking.traces_per_tag's default: a kept group's two members and a dropped group's


def episode(tag: str, split: str, k: int, group: int, env_id: int, turns: int, success: bool) -> Trajectory:
    """A trajectory whose messages hold the characters a transcript can break on (newlines, quotes,
    backslashes, non-ASCII), with one assistant and one user message per turn."""
    messages = [
        {"role": "system", "content": "You're a helpful assistant. "},
        {"role": "user", "content": "Turn 1:\n" + state(f'#_P\n"{tag}" ünï √ \\n {env_id}')},
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
                {"role": "user", "content": f"Reward:\n-0.1\nTurn {t + 2}:\n" + state(f"_#P {env_id}")}
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


def state(grid: str, actions_left: int = 3) -> str:
    """The protocol's state block around ``grid`` (what the trace's chat view fences)."""
    return state_content(TurnRecord(state=grid, actions_left=actions_left), ProtocolConfig(), 100)


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


def stored_run(cfg: RagenConfig, name: str, val_groups: int = 4) -> RunDir:
    """A run directory with ITERATIONS iterations of rollouts (filtered by the real filter stage) and
    the final evaluation."""
    run = create_run(cfg, name)
    for k in range(1, ITERATIONS + 1):
        write_trajectories(rollouts(k), run.rollouts(k))
        filter_stage(cfg, run, k)
    write_trajectories(rollouts(ITERATIONS, "val", groups=val_groups, size=1), run.eval_file(ITERATIONS))
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


def rows_by_env_of(rows: list[dict[str, Any]], trace: Any) -> dict[str, Any]:
    """The row of ``rows`` that ``trace`` shows."""
    return next(r for r in rows if r["env_id"] == int(trace.info.trace_metadata["ragen.env_id"]))


def test_the_sample_shows_kept_and_dropped_groups_of_every_tag() -> None:
    """Half of a tag's sample from groups the filter kept, half from groups it dropped (each side by
    the largest score std, a group's members side by side): a sample of kept groups only hid what the
    filter threw away."""
    table = read_table_of(rollouts(1))  # per tag 3 groups of 2: Bandit 0-2, SimpleSokoban 3-5
    scores = table.column("score").to_pylist()
    kept = [i for i, g in enumerate(table.column("group_id").to_pylist()) if g in (1, 4)]
    groups = {g.group_id: g for g in group_decisions(table, kept)}
    assert {g for g, d in groups.items() if d.kept} == {1, 4}
    assert groups[2].score_std == pytest.approx(statistics.stdev(scores[4:6]))
    assert groups[2].score_mean == pytest.approx(statistics.fmean(scores[4:6])) and groups[2].size == 2
    # dropped, by std: Bandit's group 0 (0.92) before 2 (0.28); SimpleSokoban's 3 (0.92) before 5
    assert groups[0].score_std > groups[2].score_std and groups[3].score_std > groups[5].score_std
    both = choose_train(table, 4, 64, groups)
    assert both == [0, 1, 2, 3, 6, 7, 8, 9]  # per tag: the kept group and the dropped one, both members
    assert {groups[g].kept for g in table.take(both).column("group_id").to_pylist()} == {True, False}
    assert choose_train(table, 2, 64, groups) == [0, 2, 6, 8]  # one of each side per tag
    assert choose_train(table, 1, 64, groups) == [2, 8]  # kept first
    # a cap takes the tags in turn and each tag's kept and dropped rows alternately: both sides stay
    assert choose_train(table, 4, 4, groups) == [0, 2, 6, 8]
    # a side without groups gives its share to the other; no filter record: groups by id
    all_kept = {g: dataclasses.replace(d, kept=True) for g, d in groups.items()}
    assert choose_train(table, 4, 64, all_kept) == [0, 1, 2, 3, 6, 7, 8, 9]  # largest std first
    assert choose_train(table, 2, 64, None) == [0, 1, 6, 7] and choose_train(table, 0, 64, groups) == []
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


def test_each_turns_decoding_shows_in_the_transcript_and_its_span() -> None:
    """Constrained decoding records how each turn was decoded (free where no grammar applied: WebShop's
    search page once its searches are used up); ``ragen show`` prints it and each turn's span carries it."""
    import io

    from rich.console import Console

    from ragen_core.tracking.rendering import print_transcript

    t = episode("SimpleSokoban", "train", 1, 0, 2, 3, True)
    t = dataclasses.replace(t, info={**t.info, "turn_decoding": ["free", "constrained", "constrained"]})
    row = read_table_of([t]).to_pylist()[0]
    assert [x.decoding for x in turns_of(row)] == ["free", "constrained", "constrained"]
    _, spans = build_trace(row, step=1, experiment_id="0", mlflow_run_id="r", start_ms=0)
    assert [s.attributes.get("ragen.decoding") for s in spans[1:]] == ["free", "constrained", "constrained"]
    out = io.StringIO()
    print_transcript(Console(file=out, width=200), 0, t)
    lines = [line for line in out.getvalue().splitlines() if line.lstrip().startswith("turn ")]
    assert [line.endswith("decoding") for line in lines] == [True] * 3
    assert "constrained decoding" in lines[1] and "free decoding" in lines[0]
    plain = read_table_of([episode("SimpleSokoban", "train", 1, 0, 2, 3, True)]).to_pylist()[0]
    assert {x.decoding for x in turns_of(plain)} == {None}  # a run without the option: nothing added


def test_nul_bytes_of_model_text_are_escaped_in_the_previews_postgresql_stores() -> None:
    """PostgreSQL's text columns refuse NUL: MLflow's server on it rejected a batch of traces for one."""
    row = read_table_of([episode("SimpleSokoban", "train", 1, 0, 2, 1, True)]).to_pylist()[0]
    row["messages"][1]["content"] = row["messages"][1]["content"].replace("#_P", "#_P\x00state")
    row["messages"][2]["content"] = "<answer>Up\x00</answer>"
    info, spans = build_trace(row, step=1, experiment_id="0", mlflow_run_id="r", start_ms=0)
    assert "\x00" not in info.request_preview + info.response_preview  # type: ignore[operator]
    assert "\\0state" in info.request_preview and info.response_preview == "<answer>Up\\0</answer>"  # type: ignore[operator]
    assert all("\x00" not in v for s in spans for v in s.to_dict()["attributes"].values())


def test_training_logs_episodes_as_traces_that_search_finds(store: Path, tmp_path: Path) -> None:
    cfg = config(tmp_path, "tracking.experiment=traces", "tracking.max_traces_per_step=8")
    run = stored_run(cfg, "traces", val_groups=5)
    tracker = log_steps(run, cfg, store)
    uri, exp, mlflow_run = tracker.tracking_uri, tracker.experiment_id, run.info()["mlflow_run_id"]
    assert exp is not None

    # the run's Traces tab: 4 per tag and iteration, plus the final evaluation's 10 episodes cut to 8
    assert len(search(uri, exp, run_id=mlflow_run)) == ITERATIONS * PER_TAG * len(TAGS) + 8
    for k in range(1, ITERATIONS + 1):
        record = run.read_json(run.filter_file(k))
        kept = set(record["kept_rows"])
        table = read_table(run.rollouts(k))
        rows = table.to_pylist()
        groups = {g: [r["score"] for r in rows if r["group_id"] == g] for g in {r["group_id"] for r in rows}}
        found = search(uri, exp, f"metadata.`ragen.iteration` = '{k}' AND metadata.`ragen.split` = 'train'")
        assert len(found) == PER_TAG * len(TAGS)
        for tag in TAGS:
            # the tags MLflow's list filters on: iteration, split and env tag
            of_tag = search(
                uri,
                exp,
                f"tags.`ragen.iteration` = '{k}' AND tags.`ragen.env_tag` = '{tag}' "
                "AND tags.`ragen.split` = 'train'",
            )
            assert {t.info.trace_metadata["ragen.env_tag"] for t in of_tag} == {tag} and len(
                of_tag
            ) == PER_TAG
            # a group the filter kept and a group it dropped, both members of each: two sessions
            by_decision: dict[bool, set[str]] = {True: set(), False: set()}
            for t in of_tag:
                feedback = {a.name: a.value for a in t.info.assessments}
                by_decision[feedback["filter_kept"]].add(t.info.trace_metadata["mlflow.trace.session"])
                assert t.info.tags["ragen.filter"] == ("kept" if feedback["filter_kept"] else "dropped")
                assert t.info.tags["mlflow.traceName"].endswith(t.info.tags["ragen.filter"])
            assert [len(v) for v in by_decision.values()] == [1, 1], by_decision
        dropped = search(uri, exp, f"metadata.`ragen.iteration` = '{k}' AND feedback.`filter_kept` = 'false'")
        assert len(dropped) == PER_TAG // 2 * len(TAGS)
        assert all(rows.index(rows_by_env_of(rows, t)) not in kept for t in dropped)
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
            decision = next(g for g in record["groups"] if g["group_id"] == row["group_id"])
            assert decision["kept"] is (index in kept)  # filter.json says the same, with the statistics
            assert decision["score_std"] == pytest.approx(feedback["group_reward_std"])
            check_spans(trace, row)

    # by success, across iterations and splits: exactly the Parquet's successful sampled episodes
    for success in (True, False):
        want = success_ids(run, mlflow_run, tracker, success)
        got = search(uri, exp, f"metadata.`ragen.success` = '{str(success).lower()}'")
        assert {t.info.trace_id for t in got} == want and want
        assert {
            t.info.trace_id for t in search(uri, exp, f"feedback.`success` = '{str(success).lower()}'")
        } == want

    # the final evaluation: tags in turn up to the cap, the same four assessments as a train episode
    # (no empty column in MLflow's list): validation is not filtered, every episode counts
    val = search(uri, exp, "tags.`ragen.split` = 'val'")
    rows = rows_by_env(run.eval_file(ITERATIONS))
    assert sorted(int(t.info.trace_metadata["ragen.env_id"]) for t in val) == [0, 1, 2, 3, 5, 6, 7, 8]
    for trace in val:
        row = rows[int(trace.info.trace_metadata["ragen.env_id"])]
        assert trace.info.trace_metadata["ragen.iteration"] == str(ITERATIONS)
        assert {a.name: a.value for a in trace.info.assessments} == {
            "score": row["score"],
            "success": row["success"],
            "filter_kept": True,
            "group_reward_std": 0.0,  # groups of one
        }
        assert all(a.value is not None for a in trace.info.assessments)
        assert "not filtered" in next(a for a in trace.info.assessments if a.name == "filter_kept").rationale
        assert "ragen.filter" not in trace.info.tags and trace.info.tags["ragen.split"] == "val"
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
    assert root.span_type == "AGENT" and unfenced(root.inputs["messages"]) == messages[:-1]
    assert root.outputs == messages[-1]["content"] and root.attributes["ragen.score"] == row["score"]
    assert len(turns) == row["turn_count"] == len(row["turn_rewards"])
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for t, (span, pos) in enumerate(zip(turns, assistant, strict=True)):
        assert span.span_type == "CHAT_MODEL" and span.name == f"turn {t + 1}"
        assert (
            unfenced(span.inputs["messages"]) == messages[:pos] and span.outputs == messages[pos]["content"]
        )
        assert all(  # every state of the prompt in a code fence, so Markdown keeps its lines
            m["content"].count("State:\n```\n") == m["content"].count("State:\n") >= 1
            for m in span.inputs["messages"]
            if m["role"] == "user"
        )
        reply = messages[pos + 1]["content"] if pos + 1 < len(messages) else None
        assert span.attributes.get("ragen.env_reply") == reply
        assert span.attributes["ragen.actions"] == row["actions"][t]
        assert span.attributes["ragen.reward"] == row["turn_rewards"][t]
        effective = json.loads(row["info"])["infos"][t]["action_is_effective"]
        assert span.attributes["ragen.action_is_effective"] is effective
    # the list's request column: the first state on one line, not the instructions every episode shares
    first_state = messages[1]["content"].split("State:\n")[1].split("\nYou have")[0]
    assert trace.info.request_preview == f"{row['env_tag']} seed {row['seed']}: " + " / ".join(
        first_state.splitlines()
    )
    assert trace.info.state == ("OK" if row["success"] else "ERROR")
    assert trace.info.tags["ragen.outcome"] == ("success" if row["success"] else "failed")
    assert trace.info.tags["mlflow.traceName"].startswith(
        f"{row['env_tag']} iter {trace.info.tags['ragen.iteration']} {row['split']} group {row['group_id']} "
        f"#{row['env_id']}: {trace.info.tags['ragen.outcome']}"
    )


def unfenced(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat view's messages without the code-fence lines around states: the stored text."""
    return [
        dict(
            m,
            content=m["content"]
            .replace("State:\n```\n", "State:\n")
            .replace("\n```\nYou have", "\nYou have"),
        )
        for m in messages
    ]


def frozen_lake_rollouts(answer: str) -> list[Trajectory]:
    """FrozenLake episodes played through the real env groups and agent protocol (the grids and
    messages a policy sees), every turn answered with ``answer``; 2 groups of 2."""
    from ragen_core.env_groups import EnvGroups, EnvGroupsConfig

    protocol = ProtocolConfig()
    groups = EnvGroups(
        EnvGroupsConfig(tags=["FrozenLake"], n_groups=[2], group_size=2), protocol, mode="train"
    )
    groups.reset()
    while groups.active_ids():
        groups.step({i: answer for i in groups.active_ids()})
    out = []
    for ep in groups.trajectories():
        out.append(
            Trajectory(
                run_id="lake-run",
                iteration=1,
                split="train",
                env_tag=ep.tag,
                group_id=ep.group_id,
                env_id=ep.env_id,
                seed=ep.seed,
                turn_count=ep.turns,
                success=ep.success,
                truncated=ep.truncated,
                reward=ep.reward,
                format_penalty=ep.format_penalty,
                score=ep.score,
                input_ids=[1, 2, 3],
                loss_mask=[0, 1, 1],
                turn_index=[0, 0, 0],
                rollout_logprobs=[0.0, -0.5, -0.5],
                messages=groups.messages(ep.env_id, for_generation=False),
                actions=ep.actions,
                turn_rewards=ep.turn_rewards,
                info={"end_reason": ep.end_reason, "turn_penalties": ep.turn_penalties, "infos": ep.infos},
            )
        )
    return out


def test_a_multi_turn_grid_renders_line_by_line_and_a_failed_episode_says_so(
    store: Path, tmp_path: Path
) -> None:
    """MLflow's chat view renders Markdown: a FrozenLake grid outside a code fence lost its line
    breaks and underscores, and every episode had the green "OK"/"Success" badge. Here a real
    FrozenLake iteration (one group fails on the action budget, one reaches the goal) goes through
    the filter stage and the step log into a real store; the chat messages render (CommonMark, as
    the UI's renderer) with each grid as a code block, line by line, and the failed episode's name,
    state, tags and feedback say it failed."""
    from markdown_it import MarkdownIt

    from ragen_core.run.step_log import StepLogger

    cfg = config(tmp_path, "tracking.experiment=lake")
    run = create_run(cfg, "lake")
    episodes = frozen_lake_rollouts("<think>up</think><answer>Up || Up</answer>")
    assert {e.success for e in episodes} == {True, False} and min(e.turn_count for e in episodes) > 1
    write_trajectories(episodes, run.rollouts(1))
    filter_stage(cfg, run, 1)
    tracker = Tracker(cfg.tracking, store)
    with tracker:
        mlflow_run = tracker.start("lake", {})
        StepLogger(tracker, run, "lake", cfg.trainer.iterations).log_rollouts(1)
    assert tracker.experiment_id is not None
    traces = search(tracker.tracking_uri, tracker.experiment_id, run_id=mlflow_run)
    assert len(traces) == len(episodes)  # 4 per tag: both groups, both members
    md = MarkdownIt("commonmark")
    for trace in traces:
        row = rows_by_env_of(read_table(run.rollouts(1)).to_pylist(), trace)
        check_spans(trace, row)
        turns = sorted(
            (s for s in trace.data.spans if s.parent_id is not None), key=lambda s: s.start_time_ns
        )
        last_prompt = turns[-1].inputs["messages"]
        grids = [m["content"] for m in last_prompt if m["role"] == "user"]
        assert len(grids) == row["turn_count"]
        for shown, stored in zip(grids, (m for m in row["messages"] if m["role"] == "user"), strict=True):
            grid = stored["content"].split("State:\n")[1].split("\nYou have")[0]
            assert len(grid.splitlines()) == 4 and "_" in grid  # a 4x4 FrozenLake grid
            assert f"<pre><code>{grid}\n</code></pre>" in md.render(shown)  # line by line, underscores kept
            assert "<pre>" not in md.render(stored["content"])  # what the view showed before
        failed = not row["success"]
        assert trace.info.state == ("ERROR" if failed else "OK")
        assert (
            trace.info.tags["mlflow.traceName"].split(": ")[1].startswith("failed" if failed else "success")
        )
        assert {a.name: a.value for a in trace.info.assessments}["success"] is row["success"]
        root = next(s for s in trace.data.spans if s.parent_id is None)
        assert root.status.status_code == ("ERROR" if failed else "OK")
        if failed:
            assert root.status.description == "episode failed (end: budget)"
    found = search(tracker.tracking_uri, tracker.experiment_id, "tags.`ragen.outcome` = 'failed'")
    assert {t.info.trace_id for t in found} == {t.info.trace_id for t in traces if t.info.state == "ERROR"}
    assert found and all(t.info.trace_metadata["ragen.success"] == "false" for t in found)


def test_a_resumed_run_adds_no_duplicates_and_a_failing_store_goes_offline(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path, "tracking.experiment=traces-resume")
    run = stored_run(cfg, "resume")
    tracker = log_steps(run, cfg, store)
    uri, exp, mlflow_run = tracker.tracking_uri, tracker.experiment_id, run.info()["mlflow_run_id"]
    assert exp is not None
    before = {t.info.trace_id: len(t.info.assessments) for t in search(uri, exp, run_id=mlflow_run)}
    assert len(before) == ITERATIONS * PER_TAG * len(TAGS) + 8

    # a resume re-logs the steps its MLflow run lacks (here: all of them, as after a lost server)
    again = Tracker(cfg.tracking, store)
    again.start("resume", {}, run_id=mlflow_run)
    groups = groups_of(run.read_json(run.filter_file(1)), read_table(run.rollouts(1)))
    assert again.log_episode_traces(run.rollouts(1), 1, groups) == 0
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
    assert len(search(uri, exp, run_id=mlflow_run)) == PER_TAG * len(TAGS)  # before the step's metrics
    logger.log_step(1, {"a": 1.0})
    logger.log_rollouts(2)  # the process dies before iteration 2's metrics
    assert len(search(uri, exp, run_id=mlflow_run)) == 2 * PER_TAG * len(TAGS)
    tracker.end("KILLED")

    resumed = Tracker(cfg.tracking, store)
    resumed.start("early", {}, run_id=mlflow_run)
    assert resumed.logged_steps == {1}
    again = StepLogger(resumed, run, "early", cfg.trainer.iterations)
    for k in (1, 2):
        again.log_step(k, {"a": float(k)})
    resumed.end()
    assert resumed.logged_steps == {1, 2}
    # no duplicates: 4 per tag and iteration, and the final evaluation's 8 episodes (iteration 2)
    assert len(search(uri, exp, run_id=mlflow_run)) == ITERATIONS * PER_TAG * len(TAGS) + 8
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
