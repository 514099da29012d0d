"""The filter stage with rollout.filter: what it keeps, what it logs, and an empty selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragen_core.config import load_config
from ragen_core.filter_record import GroupDecision, groups_of, kept_rows_of
from ragen_core.learner.batch import TokenBatch
from ragen_core.run import stage_record
from ragen_core.run.run_dir import RunDir, create_run
from ragen_core.run.stages import EmptyFilterError, filter_stage, learn_stage
from ragen_core.trajectory import Trajectory, read_table, write_trajectories

BASE = ["train.tags=[Bandit]", "train.n_groups=[4]", "train.group_size=2", "learner.optim.mini_batch_size=2"]
#: 4 groups of 2: scores {1, 1} std 0 / {0, 2} std 1.41 / {0, 0} std 0 / {1, 2} std 0.71;
#: sampled tokens 3, 1, 2, 2, 1, 1, 4, 2; each token's log-prob is -(group + 1)
SCORES = [1.0, 1.0, 0.0, 2.0, 0.0, 0.0, 1.0, 2.0]
TOKENS = [3, 1, 2, 2, 1, 1, 4, 2]


def _traj(i: int, scores: list[float] = SCORES) -> Trajectory:
    n = TOKENS[i]
    mask = [0] + [1] * n
    return Trajectory(
        run_id="r",
        iteration=1,
        split="train",
        env_tag="Bandit",
        group_id=i // 2,
        env_id=i,
        seed=i // 2,
        turn_count=1,
        success=False,
        truncated=False,
        reward=scores[i],
        format_penalty=0.0,
        score=scores[i],
        input_ids=list(range(1, n + 2)),
        loss_mask=mask,
        turn_index=[0] * (n + 1),
        rollout_logprobs=[-(i // 2 + 1.0) * m for m in mask],
        messages=[{"role": "user", "content": "x"}],
        actions=[["a"]],
        turn_rewards=[scores[i]],
    )


def _run(tmp_path: Path, overrides: list[str], local_state: Path) -> tuple[RunDir, object]:
    cfg = load_config(overrides=[*BASE, *overrides, f"trainer.run_root={tmp_path}"])
    run = create_run(cfg, "filter")
    write_trajectories([_traj(i) for i in range(8)], run.rollouts(1))
    return run, cfg


@pytest.mark.parametrize(
    ("overrides", "kept_rows"),
    [
        (["rollout.filter.value=0.5"], [2, 3, 6, 7]),  # std: groups 1, 3
        (["rollout.filter.value=0.5", "rollout.filter.keep=smallest"], [0, 1, 4, 5]),  # std 0 ties: 0, 2
        (
            ["rollout.filter.strategy=top_k_abs", "rollout.filter.value=1", "rollout.filter.metric=reward"],
            [6, 7],
        ),
        # linear: tau = 0.6 x 2.12 - 0.01 = 1.26, reached by group 1 (1.41) alone; 0.7: tau 1.47 needs group 3 too
        (["rollout.filter.strategy=top_p", "rollout.filter.value=0.6"], [2, 3]),
        (["rollout.filter.strategy=top_p", "rollout.filter.value=0.7"], [2, 3, 6, 7]),
        (
            ["rollout.filter.strategy=top_k", "rollout.filter.value=0.5", "rollout.filter.metric=length"],
            [0, 1, 6, 7],
        ),
        # entropy estimates: group g's tokens have log-prob -(g + 1), so 1, 2, 3, 4; min_p 0.5 keeps >= 2
        (
            ["rollout.filter.strategy=min_p", "rollout.filter.value=0.5", "rollout.filter.metric=entropy"],
            [2, 3, 4, 5, 6, 7],
        ),
        (
            [
                "rollout.filter.strategy=top_k",
                "rollout.filter.value=0.25",
                "rollout.filter.metric=reward_sum",
                "rollout.filter.keep=smallest",
                "rollout.filter.include_zero=false",
            ],
            [0, 1],
        ),
    ],
)
def test_the_filter_stage_keeps_what_the_config_asks(
    tmp_path: Path, local_state: Path, overrides: list[str], kept_rows: list[int]
) -> None:
    run, cfg = _run(tmp_path, overrides, local_state)
    kept, metrics = filter_stage(cfg, run, 1)  # type: ignore[arg-type]
    assert kept == kept_rows
    stored = json.loads(run.filter_file(1).read_text())
    assert stored["kept_rows"] == kept_rows and stored["metrics"] == metrics
    assert metrics["rollout/kept_trajectories"] == len(kept_rows)
    assert metrics["rollout/filter_kept_count"] == len(kept_rows) / 2
    assert metrics["rollout/filter_kept_ratio"] == len(kept_rows) / 8
    assert "rollout/in_group_std" in metrics and "rollout/chosen_in_group_std" in metrics


def test_filter_metrics_by_hand(tmp_path: Path, local_state: Path) -> None:
    run, cfg = _run(tmp_path, ["rollout.filter.value=0.5"], local_state)
    _, m = filter_stage(cfg, run, 1)  # type: ignore[arg-type]
    std = [0.0, 2**0.5, 0.0, 0.5**0.5]
    assert m["rollout/filter_zero_count"] == 2
    assert m["rollout/filter_metric_mean"] == pytest.approx(sum(std) / 4)
    assert m["rollout/chosen_filter_metric_mean"] == pytest.approx((std[1] + std[3]) / 2)
    assert m["rollout/in_group_std"] == pytest.approx(sum(std) / 4)


def test_filter_json_holds_each_groups_statistics_and_decision_and_older_records_still_read(
    tmp_path: Path, local_state: Path
) -> None:
    """Why a group was dropped is in the record beside the decision: its size, score mean and std and
    the filter's value of it. A record written before the groups were stored (rows only) reads the
    same decisions and statistics, recomputed from the rollouts (the filter's value then unknown)."""
    run, cfg = _run(tmp_path, ["rollout.filter.value=0.5"], local_state)
    kept, _ = filter_stage(cfg, run, 1)  # type: ignore[arg-type]
    stored = json.loads(run.filter_file(1).read_text())
    std = [0.0, 2**0.5, 0.0, 0.5**0.5]
    assert [g["group_id"] for g in stored["groups"]] == [0, 1, 2, 3]
    for g, s in zip(stored["groups"], std, strict=True):
        members = SCORES[2 * g["group_id"] : 2 * g["group_id"] + 2]
        assert g["env_tag"] == "Bandit" and g["size"] == 2
        assert g["score_mean"] == pytest.approx(sum(members) / 2)
        assert g["score_std"] == pytest.approx(s) and g["filter_value"] == pytest.approx(s)
        assert g["kept"] is (2 * g["group_id"] in kept)  # groups 1 and 3: the largest std
    assert [g["kept"] for g in stored["groups"]] == [False, True, False, True]

    table = read_table(run.rollouts(1))
    assert groups_of(stored, table) == [GroupDecision(**g) for g in stored["groups"]]
    older = {"kept_rows": stored["kept_rows"], "metrics": stored["metrics"]}
    assert groups_of(older, table) == [GroupDecision(**{**g, "filter_value": None}) for g in stored["groups"]]
    assert kept_rows_of(older) == kept_rows_of(stored) == kept


def test_a_filter_that_keeps_nothing_names_the_cause_and_the_fix(tmp_path: Path, local_state: Path) -> None:
    # every group's scores are equal (std 0) and zero groups are excluded: no candidate is left
    run, cfg = _run(
        tmp_path,
        ["rollout.filter.strategy=top_p", "rollout.filter.value=0.9", "rollout.filter.include_zero=false"],
        local_state,
    )
    write_trajectories([_traj(i, [1.0] * 8) for i in range(8)], run.rollouts(1))
    with pytest.raises(
        EmptyFilterError, match=r"kept none of the 4 groups .*4 groups have metric 0.*include_zero=true"
    ):
        filter_stage(cfg, run, 1)  # type: ignore[arg-type]
    assert not run.filter_file(1).exists()


class _RecordingSession:
    """What the learn stage uses of a Session and its learner, recording each learner step."""

    def __init__(self) -> None:
        self.learner = self
        self.learners = 3  # as a Ray session of 3 learner ranks would say
        self.at = 0
        self.steps: list[tuple[list[int], float]] = []

    def learner_to(self, k: int) -> None:
        self.at = k

    def step(
        self, batch: TokenBatch, advantage_scale: float = 1.0, behaviour_logprobs: bool = False
    ) -> dict[str, float]:
        assert not behaviour_logprobs  # on-policy: the ratio's old log-probs are recomputed
        self.steps.append((batch.group_ids.tolist(), advantage_scale))
        return {"actor/pg_loss": 0.0}

    def save_checkpoint(self, path: str, k: int) -> None:
        Path(path, "policy").mkdir(parents=True, exist_ok=True)
        Path(path, "manifest.json").write_text(json.dumps({"iteration": k}))

    def advance(self, k: int, sync_worker: bool = True) -> None:
        assert sync_worker
        self.at = k


@pytest.mark.parametrize(("mode", "scale"), [("none", 1.0), ("linear", 0.5), ("sqrt", 0.5**0.5)])
def test_the_learn_stage_scales_the_advantages_by_the_kept_fraction_of_groups(
    tmp_path: Path, local_state: Path, mode: str, scale: float
) -> None:
    """rollout.filter.loss_scaling (RAGEN-2's filter_loss_scaling) from the filter's decision on disk
    to the learner step: 2 of 4 groups kept, the step gets only their rows and the factor r, sqrt(r)
    or 1."""
    run, cfg = _run(
        tmp_path,
        ["rollout.filter.value=0.5", f"rollout.filter.loss_scaling={mode}", "monitor.collapse_every=0"],
        local_state,
    )
    kept, _ = filter_stage(cfg, run, 1)  # type: ignore[arg-type]
    session = _RecordingSession()
    learn_stage(cfg, run, 1, session, kept)  # type: ignore[arg-type]
    assert session.steps == [([1, 1, 3, 3], pytest.approx(scale))]
    assert session.at == 1 and (run.checkpoint(1) / "manifest.json").is_file()
    # the learner count is recorded with the stage, for a rerun (trainer.learners may change on resume)
    assert stage_record.made_with(run.stage_record("learn", 1)) == {"learners": 3}
