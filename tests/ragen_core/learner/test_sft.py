"""The supervised warm start: demonstrations in the rollout layout, determinism, and the acceptance run."""

from __future__ import annotations

import json
import logging
import re
import time
from collections import defaultdict

import pytest
import torch
from pydantic import ValidationError

from ragen_core.config import load_config
from ragen_core.config.model import ModelConfig
from ragen_core.config.sft import SFTConfig
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.learner.forward import shared_prefix_length
from ragen_core.learner.sft import (
    build_demonstrations,
    demo_groups_config,
    pad_batch,
    sft_loss,
    sft_progress_line,
    train_sft,
    warm_start,
)
from ragen_core.models.policies import build_tiny_policy, load_policy
from ragen_core.protocol import ProtocolConfig, forced_prefix, parse_response
from ragen_core.rollout.engine import Generation, RolloutEngine, SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import run_rollouts
from tests.ragen_core.rollout.test_runner import spans

#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


TINY = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, corpus_seeds=4, seed=3
)


@pytest.fixture(scope="module")
def policy():
    return build_tiny_policy(TINY)


class ReplayEngine(RolloutEngine):
    """'Samples' the demonstration's ids of each env's next turn, so run_rollouts rebuilds the episode."""

    def __init__(self, groups: EnvGroups, turn_ids: dict[int, list[list[int]]]) -> None:
        self.groups = groups
        self.turn_ids = turn_ids
        self.next = defaultdict(int)

    def generate(self, prompts, params, seeds=None):
        out = []
        for env_id in self.groups.active_ids():  # the runner generates for the active envs, in order
            ids = self.turn_ids[env_id][self.next[env_id]]
            self.next[env_id] += 1
            out.append(Generation(token_ids=list(ids), logprobs=[0.0] * len(ids), finish_reason="stop"))
        assert len(out) == len(prompts)
        return out

    def update_weights(self, state_dict):
        pass

    def close(self):
        pass


def replay(tok, cfg, demos, protocol=None):
    groups = EnvGroups(demo_groups_config(cfg), protocol, mode="train")
    engine = ReplayEngine(groups, {d.env_id: d.turn_ids for d in demos})
    return run_rollouts(groups, engine, tok, SamplingParams(), seed=0, iteration=0)


@pytest.mark.parametrize("think", [True, False])
def test_demos_mask_exactly_the_answers_and_match_the_runner_layout(policy, think):
    _, tok = policy
    protocol = ProtocolConfig(enable_think=think)
    cfg = SFTConfig(tags=["SimpleSokoban", "FrozenLake", "Bandit", "Countdown"], episodes_per_tag=6)
    demos = build_demonstrations(tok, cfg, protocol)
    assert len(demos) == 24 and {d.tag for d in demos} == set(cfg.tags)
    assert any(len(d.texts) >= 3 for d in demos)  # FrozenLake plays several turns
    prefix = forced_prefix(protocol)
    for d in demos:
        runs = spans(d.loss_mask)
        assert len(runs) == len(d.texts)
        for (a, b), text, acts in zip(runs, d.texts, d.actions, strict=True):
            assert tok.decode(d.input_ids[a:b]) == text + "<|im_end|>"
            assert tok.decode(d.input_ids[max(0, a - 8) : a]).endswith("<|im_start|>assistant\n" + prefix)
            parsed = parse_response(prefix + text, protocol, None if d.tag == "Countdown" else ["x"])
            assert parsed.matched and parsed.raw_actions == acts
            assert ("</think>" in text) == think
    # The same ids through the real runner give the same trajectories, token for token.
    trajs = replay(tok, cfg, demos, protocol)
    for d, t in zip(demos, trajs, strict=True):
        assert (t.env_id, t.seed, t.success) == (d.env_id, d.seed, d.success)
        assert t.input_ids == d.input_ids and t.loss_mask == d.loss_mask and t.turn_index == d.turn_index
        assert t.format_penalty == 0.0  # every demonstrated turn is well formed


def test_context_window_gives_one_sample_per_turn(policy):
    _, tok = policy
    cfg = SFTConfig(tags=["FrozenLake"], episodes_per_tag=4)
    protocol = ProtocolConfig(max_context_window=2)
    demos = build_demonstrations(tok, cfg, protocol)
    trajs = {t.env_id: t for t in replay(tok, cfg, demos, protocol)}
    by_env = defaultdict(list)
    for d in demos:
        by_env[d.env_id].append(d)
    for env_id, ds in by_env.items():
        assert len(ds) == len(ds[0].texts)
        for j, d in enumerate(ds):
            runs = spans(d.loss_mask)
            assert len(runs) == 1 and tok.decode(d.input_ids[slice(*runs[0])]) == d.texts[j] + "<|im_end|>"
            assert set(d.turn_index) <= set(range(max(0, j - 1), j + 2))  # window of 2 turns
        last, t = ds[-1], trajs[env_id]
        assert last.input_ids == t.input_ids  # the last turn's window is the runner's trajectory
        assert last.loss_mask == [
            m if k == len(ds) - 1 else 0 for m, k in zip(t.loss_mask, t.turn_index, strict=True)
        ]


def test_noise_levels_and_oracle_quality(policy):
    _, tok = policy
    clean = build_demonstrations(
        tok, SFTConfig(tags=["SimpleSokoban", "Bandit"], episodes_per_tag=16, optimal_fraction=1.0)
    )
    assert all(all(d.optimal) and d.success for d in clean)
    noisy = build_demonstrations(tok, SFTConfig(tags=["Bandit"], episodes_per_tag=64, optimal_fraction=0.0))
    assert not any(o for d in noisy for o in d.optimal)
    assert 0.3 < sum(d.success for d in noisy) / 64 < 0.7  # random arm
    mixed = build_demonstrations(tok, SFTConfig(tags=["FrozenLake"], episodes_per_tag=64))
    rate = sum(o for d in mixed for o in d.optimal) / sum(len(d.optimal) for d in mixed)
    assert 0.55 < rate < 0.85
    per_episode = build_demonstrations(
        tok, SFTConfig(tags=["FrozenLake"], episodes_per_tag=32, noise_unit="episode")
    )
    assert all(len(set(d.optimal)) == 1 for d in per_episode)


def test_demos_and_training_are_deterministic(policy, one_thread):
    model, tok = policy
    cfg = SFTConfig(
        tags=["SimpleSokoban", "FrozenLake"],
        episodes_per_tag=8,
        steps=4,
        batch_size=4,
        warmup_steps=1,
        log_every=1,
        seed=5,
    )
    a, b = build_demonstrations(tok, cfg), build_demonstrations(tok, cfg)
    assert [(d.input_ids, d.loss_mask, d.optimal) for d in a] == [
        (d.input_ids, d.loss_mask, d.optimal) for d in b
    ]
    c = build_demonstrations(tok, cfg.model_copy(update={"seed": 6}))
    assert [d.input_ids for d in a] != [d.input_ids for d in c]
    assert [d.seed for d in a] == [d.seed for d in c]  # the seed draws the noise, not the initial states
    assert min(d.seed for d in a) >= 1_000_000  # never a validation seed (123 + i) or a train seed

    init = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for _ in range(2):
        model.load_state_dict(init)
        metrics = train_sft(model, tok, cfg, demos=a)
        runs.append((metrics["loss_curve"], {k: v.clone() for k, v in model.state_dict().items()}))
    model.load_state_dict(init)
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 4
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in init)
    assert not all(torch.equal(runs[0][1][k], init[k]) for k in init)


@pytest.mark.parametrize("tags", [["FrozenLake"], ["FrozenLake", "SimpleSokoban"]])
def test_the_shared_prefix_gives_the_plain_loss_and_gradients(policy, one_thread, tags):
    """``sft.shared_prefix``: the tokens every row starts with run once, their cache repeated over the
    batch; loss and every gradient equal the plain pass's (float rounding apart), on multi-turn episodes
    of one env and of two (whose shared prefix is shorter)."""
    model, tok = policy
    demos = build_demonstrations(tok, SFTConfig(tags=tags, episodes_per_tag=4), ProtocolConfig(max_turn=3))
    ids, attn, mask = pad_batch(demos, tok.pad_token_id)
    p = shared_prefix_length(ids, mask, attn)
    assert 8 <= p <= int(mask.long().argmax(dim=1).min()) - 1  # before the first trained token's input
    assert torch.equal(ids[:, :p], ids[:1, :p].expand(len(demos), -1))
    grads = []
    for shared in (False, True):
        model.zero_grad()
        loss, n = sft_loss(model, ids, attn, mask, shared_prefix=shared)
        loss.backward()
        grads.append((loss.item(), n, {k: v.grad.clone() for k, v in model.named_parameters()}))
    (plain, n0, g0), (fast, n1, g1) = grads
    model.zero_grad()
    assert n0 == n1 == int(mask[:, 1:].sum()) and abs(plain - fast) <= 1e-5 * plain
    assert all(torch.allclose(g0[k], g1[k], rtol=1e-4, atol=1e-6) for k in g0), max(
        float((g0[k] - g1[k]).abs().max()) for k in g0
    )
    assert shared_prefix_length(ids[:1], mask[:1], attn[:1]) == 0  # one row: nothing to share
    early = mask.clone()
    early[:, 5] = True  # a trained token that early leaves no prefix worth sharing
    assert shared_prefix_length(ids, early, attn) == 0


def test_config_validation():
    with pytest.raises(ValidationError):
        SFTConfig(unknown=1)
    with pytest.raises(ValidationError):
        SFTConfig(tags=["Bandit"], env_overrides={"FrozenLake": {}})
    with pytest.raises(ValidationError):
        SFTConfig(optimal_fraction=1.5)
    with pytest.raises(ValidationError):
        SFTConfig(tags=[])


def test_max_seconds_guard_stops_training(policy, one_thread):
    model, tok = policy
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = SFTConfig(tags=["Bandit"], episodes_per_tag=4, steps=10_000, batch_size=2, max_seconds=1.0)
    metrics = train_sft(model, tok, cfg)
    model.load_state_dict(init)
    assert metrics["stopped_early"] and 0 < metrics["steps"] < 10_000


def test_the_warm_start_says_ten_times_how_far_it_is(policy, one_thread, caplog):
    model, tok = policy
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = SFTConfig(tags=["Bandit"], episodes_per_tag=4, steps=25, batch_size=2, log_every=5)
    with caplog.at_level(logging.INFO, logger="ragen.progress"):
        train_sft(model, tok, cfg)
    model.load_state_dict(init)
    lines = [r.getMessage() for r in caplog.records if r.name == "ragen.progress"]
    steps = [int(line.split(" | ")[0].split()[-1].split("/")[0]) for line in lines]
    assert steps == [3, 5, 8, 10, 13, 15, 18, 20, 23, 25]  # a line per tenth of the 25 steps
    assert "loss" not in lines[0] and " | loss " in lines[2] and lines[-1].endswith("ETA 0s")


def test_a_progress_line_reads_the_last_loss_and_the_time_left():
    line = sft_progress_line(300, 3000, [[290, 0.5], [300, 0.3621]], 105.0)
    assert line == "warm start: step 300/3000 | loss 0.362 | 1m45s | ETA 15m45s"


ACCEPT_TAGS = ["Bandit", "FrozenLake", "SimpleSokoban"]


def validation_metrics(model, tok, tags: list[str], n: int, max_new_tokens: int) -> dict[str, float]:
    """Play each tag's first ``n`` validation seeds as the evaluate stage does (mode "val", the runner,
    temperature 0.5), and add per tag what the acceptance is about: the share of played turns and of
    episodes with no format penalty, and of episodes with a turn cut at ``max_new_tokens``."""
    groups = EnvGroups(EnvGroupsConfig(tags=tags, n_groups=[n] * len(tags), group_size=1), mode="val")
    params = SamplingParams(temperature=0.5, max_new_tokens=max_new_tokens)
    trajs = run_rollouts(groups, HFEngine(model, tok), tok, params, seed=0, iteration=0, run_id="eval")
    metrics = dict(groups.metrics())
    for tag in tags:
        played = [[r for r in groups.history(t.env_id) if r.played] for t in trajs if t.env_tag == tag]
        cut = [bool(t.info.get("response_truncated")) for t in trajs if t.env_tag == tag]
        turns = [r.format_ok for episode in played for r in episode]
        metrics[f"{tag}/format_ok_turns"] = sum(turns) / len(turns)
        metrics[f"{tag}/format_ok_trajs"] = sum(all(r.format_ok for r in e) for e in played) / len(played)
        metrics[f"{tag}/response_truncated"] = sum(cut) / len(cut)
    return metrics


@pytest.mark.slow
def test_warm_start_reaches_valid_format_on_validation_seeds(tmp_path, one_thread):
    """Acceptance: one tiny multi-env policy, SFT on 70%-optimal demos, >= 95% well-formed replies on
    the fixed validation seeds at temperature 0.5 (Bandit, FrozenLake, SimpleSokoban)."""
    model_cfg = ModelConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        corpus_seeds=4,
        seed=0,
    )
    sft = SFTConfig(tags=ACCEPT_TAGS, episodes_per_tag=256, steps=300, batch_size=16, lr=3e-3, seed=0)
    t0 = time.perf_counter()
    path = warm_start(model_cfg, sft, tmp_path / "policy")
    warm_seconds = time.perf_counter() - t0
    metrics = json.loads((path / "sft_metrics.json").read_text())
    assert metrics["steps"] == 300 and not metrics["stopped_early"]
    assert 0.55 < metrics["demo_optimal_turns"] < 0.8
    assert metrics["final_loss"] < 0.5 * metrics["loss_curve"][0][1]

    model, tok = load_policy(path)  # what the pipeline will load
    t1 = time.perf_counter()
    ev = validation_metrics(model, tok, ACCEPT_TAGS, n=64, max_new_tokens=64)
    eval_seconds = time.perf_counter() - t1
    print(
        f"\nSFT warm start (one model, {len(ACCEPT_TAGS)} tags): build {metrics['build_seconds']:.1f}s, "
        f"demos {metrics['demo_seconds']:.1f}s, train {metrics['seconds']:.1f}s ({metrics['steps']} steps), "
        f"total {warm_seconds:.1f}s; eval {eval_seconds:.1f}s; final loss {metrics['final_loss']:.3f}"
    )
    for tag in ACCEPT_TAGS:
        print(
            f"  {tag:14s} success {ev[f'{tag}/success']:.3f}  format_ok turns {ev[f'{tag}/format_ok_turns']:.3f}"
            f"  episodes {ev[f'{tag}/format_ok_trajs']:.3f}  actions/episode {ev[f'{tag}/num_actions']:.2f}"
        )
    for tag in ACCEPT_TAGS:
        assert ev[f"{tag}/format_ok_turns"] >= 0.95, (tag, ev)
        assert ev[f"{tag}/format_ok_trajs"] >= 0.9, (tag, ev)
        assert ev[f"{tag}/response_truncated"] == 0.0
    assert ev["Bandit/success"] >= 0.8  # the demos pick the high arm 85% of the time
    assert ev["Bandit/num_actions"] == 1.0


def test_frozenlake_tiny_demonstrations_name_the_holes(policy):
    """configs/frozenlake-tiny.yaml sets ``think_holes`` through ``sft.env_overrides``: every
    demonstrated think text names the moves into a hole (or ``none``), and some turns have one."""
    _, tok = policy
    sft = load_config("configs/frozenlake-tiny.yaml").sft.model_copy(update={"episodes_per_tag": 16})
    demos = build_demonstrations(tok, sft)
    texts = [t for d in demos for t in d.texts]
    named = [
        re.search(r"Holes: (none|(?:Left|Down|Right|Up)(?: (?:Left|Down|Right|Up))*)\. I should", t)
        for t in texts
    ]
    assert texts and all(named), texts
    assert any(m.group(1) != "none" for m in named if m)
