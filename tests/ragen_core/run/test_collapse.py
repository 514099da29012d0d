"""Collapse metrics: the pure statistics against hand-computed values, the pair sample, and the
learner's cross log-probs against a plain forward pass."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
import torch

from ragen_core.algorithms.collapse import collapse_stats, retrieval_hits
from ragen_core.monitor import MonitorConfig
from ragen_core.run.collapse_probe import collapse_due, collapse_metrics, first_turn_pair, sample_pairs

LN2 = math.log(2)


def test_collapse_stats_match_hand_values() -> None:
    # sums [[-2, -4], [-6, -2]] over 2 tokens each: per token [[-1, -2], [-3, -1]]; own prompts 0, 1
    cross = torch.tensor([[-2.0, -4.0], [-6.0, -2.0]])
    out = collapse_stats(cross, torch.tensor([2.0, 2.0]), torch.tensor([0, 1]))
    q0 = -1 + math.log(1 + math.exp(-1)) - LN2  # logsumexp(-1, -2) - ln 2 = -1.37989
    q1 = -1 + math.log(1 + math.exp(-2)) - LN2  # logsumexp(-3, -1) - ln 2 = -1.56622
    gap = [-1 - q0, -1 - q1]
    assert out["mi_estimate"] == pytest.approx(sum(gap) / 2) == pytest.approx(0.4730524, abs=1e-6)
    assert out["mi_upper_bound"] == pytest.approx(LN2)
    assert out["conditional_entropy_est"] == pytest.approx(1.0)
    assert out["reasoning_entropy_est"] == pytest.approx(-(q0 + q1) / 2)
    std = abs(q0 - q1) / 2  # population std of two values
    assert out["marginal_std"] == pytest.approx(std) == pytest.approx(0.0931669, abs=1e-6)
    assert out["mi_zscore"] == pytest.approx(sum(g / (std + 1e-3) for g in gap) / 2)
    s0 = -2 + math.log(1 + math.exp(-2)) - LN2  # logsumexp(-2, -4) - ln 2
    s1 = -2 + math.log(1 + math.exp(-4)) - LN2  # logsumexp(-6, -2) - ln 2
    assert (
        out["mi_seq_estimate"] == pytest.approx((-2 - s0 + -2 - s1) / 2) == pytest.approx(0.620608, abs=1e-6)
    )
    assert out["conditional_entropy_seq_est"] == pytest.approx(2.0)
    assert out["retrieval_accuracy"] == 1.0 and out["retrieval_chance_level"] == 0.5
    assert out["retrieval_above_chance"] == 0.5
    assert out["retrieval_accuracy@2"] == 1.0 and out["retrieval_chance_level@2"] == 1.0  # k capped at P


def test_template_collapse_gives_zero_information_and_chance_retrieval() -> None:
    # every response equally likely under every prompt: the response says nothing about the prompt
    cross = torch.full((4, 2), -3.0)
    out = collapse_stats(cross, torch.ones(4), torch.tensor([0, 0, 1, 1]))
    assert out["mi_estimate"] == pytest.approx(0.0, abs=1e-12)
    assert out["mi_zscore"] == pytest.approx(0.0, abs=1e-9)
    assert out["marginal_std"] == pytest.approx(0.0)
    # ties go to the lower column: prompt 0's responses are "retrieved", prompt 1's are not
    assert out["retrieval_accuracy"] == 0.5 == out["retrieval_chance_level"]


def test_retrieval_ties_and_prompt_classes() -> None:
    tied = torch.zeros(1, 3)
    assert retrieval_hits(tied, torch.tensor([2]), 1).tolist() == [False]
    assert retrieval_hits(tied, torch.tensor([2]), 2).tolist() == [False]  # two lower columns tie ahead
    assert retrieval_hits(tied, torch.tensor([2]), 3).tolist() == [True]
    assert retrieval_hits(tied, torch.tensor([0]), 1).tolist() == [True]
    # columns 0 and 2 hold the same prompt text: the best of them counts for a response of column 2
    cross = torch.tensor([[-1.0, -5.0, -1.5]])
    classes = torch.tensor([0, 1, 0])
    assert retrieval_hits(cross, torch.tensor([2]), 1).tolist() == [False]
    assert retrieval_hits(cross, torch.tensor([2]), 1, classes).tolist() == [True]
    out = collapse_stats(cross, torch.ones(1), torch.tensor([2]), classes)
    assert out["retrieval_accuracy"] == 1.0
    assert out["retrieval_chance_level"] == pytest.approx(2 / 3)  # 2 of 3 columns are its prompt
    assert out["retrieval_chance_level@2"] == 1.0  # min(1, 2 x 2/3)


def test_collapse_stats_inputs() -> None:
    assert collapse_stats(torch.zeros(3, 1), torch.ones(3), torch.zeros(3, dtype=torch.long)) == {}
    assert collapse_stats(torch.zeros(0, 2), torch.ones(0), torch.zeros(0, dtype=torch.long)) == {}
    with pytest.raises(ValueError, match="cols must index the 2 prompt columns"):
        collapse_stats(torch.zeros(1, 2), torch.ones(1), torch.tensor([2]))
    with pytest.raises(ValueError, match="non-finite cross log-prob in trajectories \\[1\\]"):
        collapse_stats(torch.tensor([[0.0, 0.0], [math.nan, 0.0]]), torch.ones(2), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="n_tokens has 1 entries for 2 responses"):
        collapse_stats(torch.zeros(2, 2), torch.ones(1), torch.tensor([0, 1]))


def _row(gid: int, prompt: list[int], response: list[int], first_trained_turn: int = 0) -> dict:
    ids = prompt + response + [99]  # 99: a template token after the turn, not sampled
    mask = [0] * len(prompt) + [1] * len(response) + [0]
    return {
        "group_id": gid,
        "input_ids": ids,
        "loss_mask": mask,
        "turn_index": [0] * len(ids),
        "info": json.dumps({"first_trained_turn": first_trained_turn}),
    }


def test_first_turn_pair_and_the_deterministic_sample() -> None:
    assert first_turn_pair([1, 2, 3, 4, 5], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]) == ([1, 2], [3, 4])
    assert first_turn_pair([1, 2], [0, 0], [0, 0]) is None
    rows = [
        _row(0, [1, 2], [10]),
        _row(0, [1, 2], [11]),
        _row(0, [1, 2], [12]),  # beyond responses_per_prompt
        _row(1, [3, 4], [13]),
        _row(1, [3, 4], [14], first_trained_turn=1),  # cut by a context window: left out
        _row(2, [1, 2], [15]),  # the same prompt text as group 0: same class
        _row(3, [5], [16]),  # beyond max_prompts
    ]
    table = pa.Table.from_pylist(rows)
    s = sample_pairs(table, max_prompts=3, responses_per_prompt=2)
    assert s.prompts == [[1, 2], [3, 4]]
    assert s.classes == [0, 1, 0]
    assert s.responses == [[10], [11], [13], [15]]
    assert s.cols == [0, 0, 1, 2]

    seen: list[tuple[list[list[int]], list[list[int]]]] = []

    def score(prompts, responses):  # log p(z | x) = -1 when z follows "its" prompt class, else -3
        seen.append((list(prompts), list(responses)))
        own = {10: 0, 11: 0, 13: 1, 15: 0}
        return torch.tensor(
            [[-1.0 if own[z[0]] == j else -3.0 for j in range(len(prompts))] for z in responses]
        )

    out = collapse_metrics(table, score, MonitorConfig(collapse_prompts=3, collapse_responses_per_prompt=2))
    assert seen == [([[1, 2], [3, 4]], [[10], [11], [13], [15]])]  # each distinct prompt scored once
    assert out["collapse/num_responses"] == 4 and out["collapse/num_prompts"] == 3
    assert out["collapse/num_distinct_prompts"] == 2
    assert out["collapse/retrieval_accuracy"] == 1.0
    # columns [class 0, class 1, class 0]: response of prompt class 0 has q = log((2e^-1 + e^-3)/3)
    q_a = math.log((2 * math.exp(-1) + math.exp(-3)) / 3)
    q_b = math.log((math.exp(-1) + 2 * math.exp(-3)) / 3)
    assert out["collapse/mi_estimate"] == pytest.approx((3 * (-1 - q_a) + (-1 - q_b)) / 4)
    assert out["timing_s/collapse"] >= 0


def test_collapse_due_and_off_switch() -> None:
    cfg = MonitorConfig(collapse_every=5)
    assert [k for k in range(0, 12) if collapse_due(cfg, k)] == [1, 5, 10]
    assert not any(collapse_due(MonitorConfig(collapse_every=0), k) for k in range(10))
    assert [k for k in range(0, 11) if collapse_due(MonitorConfig(), k)] == [1, 5, 10]  # RAGEN-2's every 5
    assert [k for k in range(0, 4) if collapse_due(MonitorConfig(collapse_every=1), k)] == [1, 2, 3]


def test_learner_cross_logprobs_equal_a_plain_forward_pass() -> None:
    from ragen_core.config.learner import LearnerConfig, OptimConfig
    from ragen_core.learner.update import Learner
    from tests.ragen_core.learner.test_learner import tiny_policy

    learner = Learner(tiny_policy(), LearnerConfig(optim=OptimConfig(micro_batch_size=3, mini_batch_size=4)))
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8], [9, 10, 11]]
    got = learner.cross_logprobs(prompts, responses)
    assert got.shape == (3, 2) and got.dtype == torch.float64
    for i, z in enumerate(responses):
        for j, x in enumerate(prompts):
            ids = torch.tensor([x + z])
            with torch.no_grad():
                logp = torch.log_softmax(learner.policy(input_ids=ids).logits[0].double(), dim=-1)
            want = sum(float(logp[len(x) + t - 1, tok]) for t, tok in enumerate(z))
            assert float(got[i, j]) == pytest.approx(want, abs=1e-4), (i, j)
    assert all(torch.equal(v, learner.policy.state_dict()[k]) for k, v in before.items())  # weights untouched
    assert learner.cross_logprobs([], responses).shape == (3, 0)
