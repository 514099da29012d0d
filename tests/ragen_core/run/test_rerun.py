"""What a rerun runs with: the run's config as the iteration ran (the learner count it recorded)."""

from __future__ import annotations

from pathlib import Path

from ragen_core.config import load_config
from ragen_core.run import stage_record
from ragen_core.run.rerun import rerun_config
from ragen_core.run.run_dir import create_run


def test_a_rerun_uses_the_learner_count_each_iteration_ran_with(tmp_path: Path, local_state: Path) -> None:
    """Iteration 1 learned on 2 learners, then the run resumed with 1 (trainer.learners=1 in its
    config): a rerun of iteration 1 takes 2, of iteration 2 takes 1; an iteration without a record of
    its count (an older version's) takes the config's."""
    run = create_run(load_config(overrides=["trainer.learners=1", f"trainer.run_root={tmp_path}"]), "elastic")
    for k, learners in ((1, 2), (2, 1)):
        record = run.stage_record("learn", k)
        stage_record.save(record, {}, [], {}, {"learners": learners})
    assert rerun_config(run, 1).trainer.learners == 2
    assert rerun_config(run, 2).trainer.learners == 1
    assert rerun_config(run, 3).trainer.learners == 1
    assert rerun_config(run, 1).learner == run.config().learner  # nothing else changes


def _episode(env_id: int, tag: str, observations: list[str], answers: list[str]) -> dict[str, object]:
    messages = [{"role": "system", "content": "sys"}]
    for obs, answer in zip(observations, answers, strict=True):
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": answer}]
    return {
        "env_id": env_id,
        "seed": 100 + env_id,
        "env_tag": tag,
        "messages": messages,
        "turn_rewards": [0.0] * len(answers),
    }


def test_a_rerun_that_parts_first_in_a_remote_servers_answer_blames_that_server() -> None:
    """Episode 1's reset answered another board (message 1); episode 0's policy then answered otherwise
    at turn 1 (message 2, later: the episodes share a batch): the server's, named with its URL. A
    policy answer that parts before any server answer, or a local tag's environment, is ours."""
    from ragen_core.env_groups import RemoteEnvConfig
    from ragen_core.run.rerun import _server_divergence

    remote = {"Lake": RemoteEnvConfig(url="ws://127.0.0.1:9")}
    stored = [_episode(0, "Lake", ["a", "b"], ["x", "y"]), _episode(1, "Lake", ["a", "b"], ["x", "y"])]
    rerun = [_episode(0, "Lake", ["a", "b"], ["x2", "y"]), _episode(1, "Lake", ["A", "b"], ["x", "y"])]
    tag, why = _server_divergence(rerun, stored, remote) or ("", "")
    assert tag == "Lake" and "ws://127.0.0.1:9" in why and "seed 101" in why and "reset" in why
    # later in the episode: turn 1's answer got another observation
    rerun = [_episode(0, "Lake", ["a", "B"], ["x", "y2"]), stored[1]]
    assert "turn 1's answer" in (_server_divergence(rerun, stored, remote) or ("", ""))[1]
    # an episode that ended earlier after the same answers: the server said done
    rerun = [_episode(0, "Lake", ["a"], ["x"]), stored[1]]
    assert "ended" in (_server_divergence(rerun, stored, remote) or ("", ""))[1]
    # the policy parted first (turn 1's answer, before turn 2's observation differed elsewhere): ours
    rerun = [_episode(0, "Lake", ["a", "b"], ["x2", "y"]), _episode(1, "Lake", ["a", "B"], ["x", "y"])]
    assert _server_divergence(rerun, stored, remote) is None
    # a local tag's environment answering otherwise is ours too
    rerun = [stored[0], _episode(1, "Lake", ["A", "b"], ["x", "y"])]
    assert _server_divergence(rerun, stored, {}) is None
    assert _server_divergence(rerun, stored, {"Other": remote["Lake"]}) is None
