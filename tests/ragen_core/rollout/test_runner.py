"""The multi-turn rollout runner: token-exact trajectories, log-prob agreement, determinism."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragen_core.config.model import ModelConfig
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.models.policies import build_tiny_policy
from ragen_core.protocol import ProtocolConfig
from ragen_core.rollout.engine import PromptTooLongError, RolloutEngine, SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import ChatTemplateError, run_rollouts
from ragen_core.trajectory import read_trajectories, write_trajectories

ROOT = Path(__file__).resolve().parents[3]
TINY = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, corpus_seeds=4, seed=3
)


@pytest.fixture(scope="module")
def policy():
    return build_tiny_policy(TINY)


def sokoban_rollouts(
    policy, n_groups=16, group_size=4, max_turn=3, max_new_tokens=24, seed=7, window=-1, training="last"
):
    model, tok = policy
    groups = EnvGroups(
        EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[n_groups], group_size=group_size),
        ProtocolConfig(max_turn=max_turn, max_context_window=window, window_training=training),
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    return run_rollouts(
        groups, HFEngine(model, tok), tok, params, seed=seed, seed_round=2, iteration=3, run_id="t"
    )


def recomputed_logprobs(model, trajs):
    out = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.input_ids])
            lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1]
            out.append(torch.cat([torch.zeros(1), lp.gather(-1, ids[0, 1:, None])[:, 0]]))
    return out


def spans(mask):
    """(start, end) of the runs of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class NoReuseEngine(HFEngine):
    """HFEngine with a full prefill every turn (its ``conversations`` is the base class's no-op)."""

    conversations = RolloutEngine.conversations


def test_turns_reuse_the_kv_cache_and_give_the_same_trajectories(policy):
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_new_tokens=24)

    def play(engine):
        groups = EnvGroups(
            EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[6], group_size=2), ProtocolConfig(max_turn=3)
        )
        return run_rollouts(groups, engine, tok, params, seed=5, seed_round=1, iteration=2)

    reuse, full = HFEngine(model, tok), NoReuseEngine(model, tok)
    a, b = play(reuse), play(full)
    assert max(t.turn_count for t in a) >= 2
    assert reuse.prefix_stats["reused"] > reuse.prefix_stats["prefilled"] > 0
    assert full.prefix_stats["reused"] == 0
    assert [t.input_ids for t in a] == [t.input_ids for t in b]
    for x, y in zip(a, b, strict=True):
        assert x.rollout_logprobs == pytest.approx(y.rollout_logprobs, abs=1e-5)


def test_logprobs_agree_and_mask_covers_exactly_the_sampled_tokens(policy):
    model, tok = policy
    trajs = sokoban_rollouts(policy)
    assert len(trajs) == 64 and all(t.turn_count >= 2 for t in trajs[:4])
    recomputed = recomputed_logprobs(model, trajs)
    worst = 0.0
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for t, lp in zip(trajs, recomputed, strict=True):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        worst = max(worst, (lp[mask] - torch.tensor(t.rollout_logprobs)[mask]).abs().max().item())
        assert all(v == 0.0 for v, m in zip(t.rollout_logprobs, t.loss_mask, strict=True) if not m)
        runs = spans(t.loss_mask)
        assert len(runs) == t.turn_count  # one sampled span per assistant turn, nothing else
        for k, (a, b) in enumerate(runs):
            # Just before each sampled span: the template's assistant header and the forced prefix.
            before = tok.decode(t.input_ids[max(0, a - 8) : a])
            assert before.endswith("<|im_start|>assistant\n<think>"), before
            # A sampled span ends with the end-of-turn token, or the runner closed it (unmasked).
            assert t.input_ids[b - 1] == eos or t.input_ids[b] == eos
            if k + 1 < len(runs):  # between two turns: environment feedback, all unmasked
                between = tok.decode(t.input_ids[b : runs[k + 1][0]])
                assert "<|im_start|>user\nReward:" in between and "State:" in between
        # Everything unmasked decodes to template and env text: the transcript minus the samples.
        head = tok.decode(t.input_ids[: runs[0][0]])
        assert head.startswith("<|im_start|>system\nYou're a helpful assistant.")
        assert "Turn 1:\nState:" in head
    assert worst <= 1e-4, worst


def test_context_window_trains_only_the_last_window(policy):
    trajs = sokoban_rollouts(policy, n_groups=2, group_size=2, max_turn=3, window=1)
    for t in trajs:
        runs = spans(t.loss_mask)
        # the last turn only (docs/architecture.md, "Deliberate differences from RAGEN": context window)
        assert len(runs) == 1
        assert "Turn 2:" not in (t.messages[1]["content"])


def test_every_turn_training_stores_each_turn_after_the_prompt_it_was_sampled_from(policy):
    """agent.window_training=every_turn: a row holds one sequence per turn, its context window and its
    answer; the same episodes as the last-window rows, every turn trained, and the learner's log-probs
    of each sequence run on its own equal the rollout's."""
    from ragen_core.learner.batch import to_token_batch
    from ragen_core.learner.forward import token_logprobs
    from ragen_core.trajectory import to_table

    model, tok = policy
    last = sokoban_rollouts(policy, n_groups=2, group_size=2, max_turn=3, window=1)
    every = sokoban_rollouts(policy, n_groups=2, group_size=2, max_turn=3, window=1, training="every_turn")
    assert any(t.turn_count > 1 for t in every)
    for a, b in zip(last, every, strict=True):
        assert (a.actions, a.score) == (b.actions, b.score)  # the training mode does not change the play
        starts = b.info["segment_starts"]
        assert len(starts) == b.turn_count == len(spans(b.loss_mask))  # one trained answer per turn
        assert b.input_ids[starts[-1] :] == a.input_ids  # the last sequence is the last window's row
        for k, s in enumerate(starts):
            head = tok.decode(b.input_ids[s : s + 12])
            assert head.startswith("<|im_start|>system"), head
            assert set(b.turn_index[s : [*starts, len(b.input_ids)][k + 1]]) == {k}
        assert b.info["first_trained_turn"] == 0
        assert sum(m["role"] == "assistant" for m in b.messages) == b.turn_count  # the whole transcript
    batch = to_token_batch(to_table(every))
    assert batch.segments is not None
    mask = batch.loss_mask != 0
    with torch.no_grad():
        logp, _ = token_logprobs(
            model, batch.input_ids, mask, torch.autocast("cpu", enabled=False), segments=batch.segments
        )
        whole, _ = token_logprobs(model, batch.input_ids, mask, torch.autocast("cpu", enabled=False))
    gap = (logp - batch.rollout_logprobs)[mask].abs().max()
    assert gap <= 1e-4, gap
    later = mask & (batch.segments > 0)
    assert (whole - batch.rollout_logprobs)[later].abs().max() > 1e-3  # run as one sequence, they differ


def test_same_seed_same_parquet_bytes_in_two_processes(policy, tmp_path):
    here = write_trajectories(sokoban_rollouts(policy, n_groups=4, group_size=2), tmp_path / "a.parquet")
    code = (
        "import sys; from tests.ragen_core.rollout.test_runner import TINY, sokoban_rollouts;"
        "from ragen_core.models.policies import build_tiny_policy;"
        "from ragen_core.trajectory import write_trajectories;"
        "write_trajectories(sokoban_rollouts(build_tiny_policy(TINY), n_groups=4, group_size=2), sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b.parquet")], cwd=ROOT, check=True)
    assert here.read_bytes() == (tmp_path / "b.parquet").read_bytes()
    other = write_trajectories(
        sokoban_rollouts(policy, n_groups=4, group_size=2, seed=8), tmp_path / "c.parquet"
    )
    assert other.read_bytes() != here.read_bytes()
    assert read_trajectories(here)[0].input_ids == read_trajectories(tmp_path / "b.parquet")[0].input_ids


def test_turns_without_end_of_turn_are_cut_and_closed(policy):
    _, tok = policy
    trajs = sokoban_rollouts(policy, n_groups=2, group_size=1, max_turn=2, max_new_tokens=3)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for t in trajs:
        assert t.info["turns_cut_by_max_new_tokens"] >= 1 and t.info["response_truncated"]
        for a, b in spans(t.loss_mask):
            assert b - a <= 3
            if t.input_ids[b - 1] != eos:
                assert t.input_ids[b] == eos and t.loss_mask[b] == 0


def test_prompt_longer_than_context_is_a_clear_error(policy):
    model, tok = policy
    groups = EnvGroups(EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[1], group_size=1))
    engine = HFEngine(model, tok, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="tokens but the model context is 64"):
        run_rollouts(groups, engine, tok, SamplingParams(max_new_tokens=8), seed=0)


def test_tokenizer_without_chat_template_is_refused(policy):
    model, tok = policy
    import copy

    bare = copy.deepcopy(tok)
    bare.chat_template = None
    groups = EnvGroups(EnvGroupsConfig(tags=["Bandit"], n_groups=[1], group_size=1))
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        run_rollouts(groups, HFEngine(model, bare), bare, SamplingParams(max_new_tokens=4), seed=0)


def test_rows_carry_the_iteration_label_and_the_seed_round_alone_picks_the_episodes(policy):
    """The pipeline labels iteration k's rows k while it plays seed round k - 1 (and validation
    always round 0): relabelling never changes what is played."""
    model, tok = policy

    def play(seed_round, iteration):
        groups = EnvGroups(
            EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[2], group_size=2), ProtocolConfig(max_turn=2)
        )
        params = SamplingParams(temperature=1.0, max_new_tokens=8)
        return run_rollouts(
            groups, HFEngine(model, tok), tok, params, seed=3, seed_round=seed_round, iteration=iteration
        )

    a, b, c = play(4, 5), play(4, 12), play(5, 5)
    assert {t.iteration for t in a} == {5} and {t.iteration for t in b} == {12}
    assert [(t.seed, t.input_ids) for t in a] == [(t.seed, t.input_ids) for t in b]
    assert [t.seed for t in c] != [t.seed for t in a]
