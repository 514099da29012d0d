"""Learner: micro-batch independence, metrics, bad input, toy-task learning, LoRA.

The helpers here (a tiny Qwen2 policy, a learner config, random batches) serve the checkpoint, critic
and learner-actor tests too.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ragen_core.algorithms import entropy_from_logits, filter_rollouts
from ragen_core.config.learner import AlgorithmConfig, LearnerConfig, OptimConfig
from ragen_core.learner.batch import BadBatchError, TokenBatch
from ragen_core.learner.forward import shared_prefix_length
from ragen_core.learner.update import Learner

VOCAB = 16
ANSWERS = (5, 6)  # the two answer tokens of the toy task


# ------------------------------------------------------------------------------------------ helpers


#: tiny models: one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_policy(seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = 64) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg).to(dtype)


def make_cfg(**algorithm) -> LearnerConfig:
    optim = algorithm.pop("optim", {})
    return LearnerConfig(
        algorithm=AlgorithmConfig(**algorithm),
        optim=OptimConfig(
            **{"actor_lr": 1e-3, "critic_lr": 1e-3, "mini_batch_size": 4, "micro_batch_size": 2, **optim}
        ),
    )


def random_batch(n: int = 8, seed: int = 0, max_len: int = 14) -> TokenBatch:
    """Two-turn trajectories of varying length: prompt (turn 0), answer (1), env text (2), answer (3)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, max_len + 1, (n,), generator=g)
    pos = torch.arange(max_len)[None, :]
    attention = (pos < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (n, max_len), generator=g) * attention
    turn = torch.zeros(n, max_len, dtype=torch.long)
    turn[:, 4:6], turn[:, 6:8], turn[:, 8:] = 1, 2, 3
    turn = turn * attention
    loss_mask = (((turn == 1) | (turn == 3)) & (attention == 1)).float()
    rollout_logprobs = -torch.rand(n, max_len, generator=g) * loss_mask
    return TokenBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        turn_index=turn,
        rollout_logprobs=rollout_logprobs,
        scores=torch.randn(n, generator=g),
        group_ids=torch.arange(n) // 4,
    )


def toy_rollout(policy, n_groups: int, group_size: int, gen: torch.Generator) -> tuple[TokenBatch, float]:
    """Prompt [1, 7+g, 2, 3]; the policy picks one of two answer tokens (sampled among those two).

    Even groups are rewarded for token 5, odd groups for token 6. Returns the batch and the mean
    probability of the rewarded answer over the groups (the expected reward).
    """
    prompts = torch.tensor([[1, 7 + g, 2, 3] for g in range(n_groups)])
    with torch.no_grad():
        logits = policy(input_ids=prompts).logits[:, -1].float()
    full_logp = logits.log_softmax(-1)
    p_first = torch.softmax(logits[:, list(ANSWERS)], -1)[:, 0]
    good = [ANSWERS[g % 2] for g in range(n_groups)]
    p_good = torch.stack([p_first[g] if good[g] == ANSWERS[0] else 1 - p_first[g] for g in range(n_groups)])
    ids, scores, rl = [], [], []
    for g in range(n_groups):
        for _ in range(group_size):
            tok = ANSWERS[0] if float(torch.rand((), generator=gen)) < float(p_first[g]) else ANSWERS[1]
            ids.append([*prompts[g].tolist(), tok])
            scores.append(float(tok == good[g]))
            rl.append([0.0] * 4 + [float(full_logp[g, tok])])
    n = len(ids)
    loss_mask = torch.zeros(n, 5)
    loss_mask[:, 4] = 1
    batch = TokenBatch(
        input_ids=torch.tensor(ids),
        attention_mask=torch.ones(n, 5, dtype=torch.long),
        loss_mask=loss_mask,
        turn_index=torch.tensor([[0, 0, 0, 0, 1]] * n),
        rollout_logprobs=torch.tensor(rl),
        scores=torch.tensor(scores),
        group_ids=torch.arange(n) // group_size,
    )
    return batch, float(p_good.mean())


def subset(batch: TokenBatch, keep: torch.Tensor) -> TokenBatch:
    fields = {k: getattr(batch, k) for k in TokenBatch.__dataclass_fields__}
    return TokenBatch(**{k: v[keep] if v is not None else None for k, v in fields.items()})


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ------------------------------------------------------------------------------------------ the step


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_micro_batch_size_does_not_change_the_update(estimator):
    batch = random_batch(8, seed=1)
    results = []
    for mbs in (1, 2, 4):
        cfg = make_cfg(
            adv_estimator=estimator,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            entropy_coeff=0.01,
            optim={"micro_batch_size": mbs, "mini_batch_size": 4, "ppo_epochs": 2},
        )
        learner = Learner(tiny_policy(dtype=torch.float64), cfg)
        metrics = learner.step(batch)
        results.append((weights(learner.policy), learner.critic and weights(learner.critic), metrics))
    for policy_w, critic_w, metrics in results[1:]:
        assert max_diff(policy_w, results[0][0]) < 1e-9
        if critic_w is not None:
            assert max_diff(critic_w, results[0][1]) < 1e-9
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert metrics[key] == pytest.approx(results[0][2][key], rel=1e-9, abs=1e-12)
    # something was learnt, and the second mini-batch / epoch was off-policy (ratio != 1)
    assert max_diff(results[0][0], weights(tiny_policy(dtype=torch.float64))) > 1e-4
    assert results[0][2]["actor/ppo_kl"] != 0.0


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_old_logprobs_from_the_update_give_the_same_step_one_pass_fewer(estimator):
    """A single-update step (ppo_epochs 1, one mini-batch) reads its old log-probs from the update's own
    forward pass: the same weights and metrics as the separate pass, and no old_log_prob timing."""
    batch = random_batch(8, seed=3)
    results = []
    for from_update in (False, True):
        cfg = make_cfg(
            adv_estimator=estimator,
            entropy_coeff=0.01,
            optim={"mini_batch_size": 8, "micro_batch_size": 3, "old_logprobs_from_update": from_update},
        )
        learner = Learner(tiny_policy(dtype=torch.float64), cfg)
        metrics = learner.step(batch)
        results.append((weights(learner.policy), metrics))
    (w_sep, m_sep), (w_upd, m_upd) = results
    assert max_diff(w_sep, w_upd) < 1e-9 and max_diff(w_sep, weights(tiny_policy(dtype=torch.float64))) > 1e-4
    for key in ("actor/pg_loss", "actor/grad_norm", "rollout/old_log_prob", "actor/entropy"):
        assert m_upd[key] == pytest.approx(m_sep[key], rel=1e-9, abs=1e-12), key
    assert m_upd["actor/ppo_kl"] == 0.0 and m_upd["actor/pg_clipfrac"] == 0.0
    assert "timing_s/old_log_prob" in m_sep and "timing_s/old_log_prob" not in m_upd
    # two mini-batches: the second is off-policy, so the separate pass is kept
    cfg = make_cfg(adv_estimator=estimator, optim={"mini_batch_size": 4, "old_logprobs_from_update": True})
    assert "timing_s/old_log_prob" in Learner(tiny_policy(dtype=torch.float64), cfg).step(batch)


def test_logprobs_and_entropy_match_full_logits():
    learner = Learner(tiny_policy(dtype=torch.float64), make_cfg(adv_estimator="grpo"))
    batch = random_batch(4, seed=5)
    ids, mask = batch.input_ids, batch.loss_mask != 0
    logp, entropy = learner._logprobs(learner.policy, ids, mask, with_entropy=True)
    with torch.no_grad():
        logits = learner.policy(input_ids=ids).logits[:, :-1]
    full_logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    full_entropy = entropy_from_logits(logits)
    on = mask[:, 1:]
    assert torch.allclose(logp[:, 1:][on], full_logp[on], atol=1e-12)
    assert torch.allclose(entropy[:, 1:][on], full_entropy[on], atol=1e-12)
    assert bool((logp[:, 1:][~on] == 0).all()) and bool((logp[:, 0] == 0).all())


def shared_prompt_batch(n: int = 8, seed: int = 0, prompt: int = 12) -> TokenBatch:
    """``random_batch``'s layout behind a ``prompt``-token opening every row shares (system prompt and
    instruction), and with a second prompt row that shares only part of it."""
    b = random_batch(n, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    head = torch.randint(1, VOCAB, (prompt,), generator=g).expand(n, -1).clone()
    head[n // 2 :, prompt - 2 :] = (
        head[n // 2 :, prompt - 2 :] % (VOCAB - 1) + 1
    )  # the second half's instruction ends differently
    ones = torch.ones(n, prompt, dtype=torch.long)

    def cat(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        return torch.cat([first.to(x.dtype), x], dim=1)

    return TokenBatch(
        input_ids=cat(b.input_ids, head),
        attention_mask=cat(b.attention_mask, ones),
        loss_mask=cat(b.loss_mask, 0 * ones),
        turn_index=cat(b.turn_index, 0 * ones),
        rollout_logprobs=cat(b.rollout_logprobs, 0 * ones),
        scores=b.scores,
        group_ids=b.group_ids,
    )


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_shared_prefix_gives_the_same_step(estimator):
    """``learner.shared_prefix``: each micro-batch's common opening runs once and its cache is repeated
    over the rows; weights and metrics after a step (entropy, KL, two mini-batches) equal the plain
    step's up to float32 rounding: Qwen2's RMSNorm computes in float32 even in a float64 model, and the
    shared rows' gradients reach it summed, where the plain pass sums them later (log-probs and entropies
    themselves come out bitwise equal)."""
    batch = shared_prompt_batch(8, seed=2)
    mask = batch.loss_mask != 0
    assert shared_prefix_length(batch.input_ids[:4], mask[:4]) == 12
    assert shared_prefix_length(batch.input_ids, mask) == 10  # where the two halves part
    results = []
    for shared in (False, True):
        cfg = make_cfg(
            adv_estimator=estimator,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            entropy_coeff=0.01,
            optim={"mini_batch_size": 4, "micro_batch_size": 4},
        ).model_copy(update={"shared_prefix": shared})
        learner = Learner(tiny_policy(dtype=torch.float64), cfg)
        metrics = learner.step(batch)
        results.append((weights(learner.policy), metrics))
    (w_plain, m_plain), (w_shared, m_shared) = results
    assert max_diff(w_plain, w_shared) < 1e-6
    assert max_diff(w_plain, weights(tiny_policy(dtype=torch.float64))) > 1e-4
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert m_shared[key] == pytest.approx(m_plain[key], rel=1e-6, abs=1e-9), key


def test_bf16_autocast_on_cpu_is_opt_in_and_close_to_float32():
    """``bf16_autocast_on_cpu`` runs the forward passes in bf16 (weights stay fp32): off by default,
    and when on the log-probs move by bf16 rounding, not more."""
    batch = random_batch(4, seed=5)
    mask = batch.loss_mask != 0
    fp32 = Learner(tiny_policy(), make_cfg(adv_estimator="grpo"))
    bf16_cfg = make_cfg(adv_estimator="grpo").model_copy(update={"bf16_autocast_on_cpu": True})
    bf16 = Learner(tiny_policy(), bf16_cfg)
    with torch.no_grad():
        ref, _ = fp32._logprobs(fp32.policy, batch.input_ids, mask)
        low, _ = bf16._logprobs(bf16.policy, batch.input_ids, mask)
    gap = float((ref - low).abs().max())
    assert 0 < gap < 0.05
    assert low.dtype == torch.float32 and next(bf16.policy.parameters()).dtype == torch.float32
    assert math.isfinite(bf16.step(batch)["actor/grad_norm"])


def test_step_metrics_have_ragen_names():
    cfg = make_cfg(use_kl_loss=True, kl_loss_coef=0.01)
    metrics = Learner(tiny_policy(), cfg).step(random_batch(8))
    expected = [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/kl_loss",
        "actor/skipped_steps",
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/vf_explained_var",
        "critic/advantages/mean",
        "critic/advantages/max",
        "critic/advantages/min",
        "critic/returns/mean",
        "critic/values/mean",
        "critic/score/mean",
        "critic/score/max",
        "critic/score/min",
        "rollout/old_vs_rollout_logprob_diff",
        "rollout/ref_log_prob",
        "perf/tokens_per_s",
        "perf/step_s",
        "response_length/mean",
    ]
    assert not [k for k in expected if k not in metrics]
    assert all(isinstance(v, float | int) and math.isfinite(v) for v in metrics.values())
    assert metrics["actor/lr"] == 1e-3
    assert metrics["rollout/old_vs_rollout_logprob_diff"] > 0


def test_other_estimators_and_options_run():
    batch = random_batch(8, seed=2)
    turn_scores = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    for cfg_kwargs, extra in [
        ({"adv_estimator": "rloo"}, {}),
        ({"adv_estimator": "reinforce_pp", "use_kl_in_reward": True, "kl_coef": 0.1}, {}),
        ({"bi_level_gae": True}, {}),
        ({"bi_level_gae": True, "use_kl_in_reward": True, "kl_coef": 0.1}, {"turn_scores": turn_scores}),
        (
            {"loss_agg_mode": "seq-mean-token-mean", "optim": {"critic": "shared_backbone", "shuffle": True}},
            {},
        ),
    ]:
        learner = Learner(tiny_policy(), make_cfg(**cfg_kwargs))
        before = weights(learner.policy)
        metrics = learner.step(batch, **extra)
        assert max_diff(before, weights(learner.policy)) > 0, cfg_kwargs
        assert math.isfinite(metrics["actor/pg_loss"])


def test_bi_level_gae_uses_turn_scores():
    batch = random_batch(8, seed=3)
    a = Learner(tiny_policy(), make_cfg(bi_level_gae=True))
    b = Learner(tiny_policy(), make_cfg(bi_level_gae=True))
    ma = a.step(batch)
    mb = b.step(batch, turn_scores=torch.stack([torch.zeros(8), batch.scores], dim=1))
    # the score on the last turn is the default: same result as passing it explicitly
    assert ma["critic/returns/mean"] == pytest.approx(mb["critic/returns/mean"])
    assert max_diff(weights(a.policy), weights(b.policy)) == 0.0


def test_non_finite_gradient_skips_the_step():
    learner = Learner(tiny_policy(), make_cfg(adv_estimator="grpo", optim={"mini_batch_size": 8}))
    before = weights(learner.policy)
    param = next(learner.policy.parameters())
    handle = param.register_hook(lambda g: g * float("nan"))
    metrics = learner.step(random_batch(8))
    handle.remove()
    assert metrics["actor/skipped_steps"] == 1 and not math.isfinite(metrics["actor/grad_norm"])
    assert max_diff(before, weights(learner.policy)) == 0.0
    assert learner.skipped_steps == 1


# ------------------------------------------------------------------------------------------ bad input


def _replace(batch: TokenBatch, **fields) -> TokenBatch:
    return TokenBatch(**{**{k: getattr(batch, k) for k in TokenBatch.__dataclass_fields__}, **fields})


def test_bad_input_raises_clear_errors_and_changes_nothing():
    learner = Learner(tiny_policy(), make_cfg())
    before = weights(learner.policy), weights(learner.critic)
    good = random_batch(8)
    scores = good.scores.clone()
    scores[3] = float("nan")
    cases = [
        (_replace(good, scores=scores), r"non-finite reward .*\[3\]"),
        (subset(good, torch.zeros(8, dtype=torch.bool)), "0 trajectories after filtering"),
        (_replace(good, loss_mask=good.loss_mask[:, :-1]), "disagree in shape"),
        (_replace(good, scores=good.scores[:5]), "disagree in shape"),
        (subset(good, torch.arange(8) < 3), r"optim\.mini_batch_size=4 .* 3 trajectories"),
        (_replace(good, input_ids=good.input_ids + 100), "vocabulary"),
        (_replace(good, loss_mask=torch.zeros_like(good.loss_mask)), "no trained token"),
        (  # a second sequence that opens on the first answer token (position 4)
            _replace(
                good, segments=torch.where(good.attention_mask == 1, (torch.arange(14) >= 4).long(), -1)
            ),
            "starts with a trained token",
        ),
    ]
    for batch, pattern in cases:
        with pytest.raises(BadBatchError, match=pattern):
            learner.step(batch)
    assert learner.global_step == 0 and not learner.actor_optim.state
    assert max_diff(before[0], weights(learner.policy)) == 0.0
    assert max_diff(before[1], weights(learner.critic)) == 0.0


# ------------------------------------------------------------------------------------------ learning


def _train_toy(
    name: str,
    learner: Learner,
    n_groups: int,
    group_size: int,
    filter_value: float | None,
    max_steps: int = 60,
) -> tuple[int, float, float]:
    gen = torch.Generator().manual_seed(123)
    _, p0 = toy_rollout(learner.policy, n_groups, group_size, gen)
    for step in range(max_steps + 1):
        batch, p_good = toy_rollout(learner.policy, n_groups, group_size, gen)
        if p_good >= 0.9:
            return step, p0, p_good
        if filter_value is not None:
            batch = subset(batch, filter_rollouts(batch.scores, batch.group_ids, "top_k", filter_value).keep)
        learner.step(batch)
    return max_steps + 1, p0, p_good


TOY_STEPS: dict[str, int] = {}


@pytest.mark.parametrize(
    ("name", "estimator", "filter_value"),
    [("ppo", "gae", None), ("grpo", "grpo", None), ("starpo-s", "gae", 0.5)],
)
def test_toy_task_is_learnt(name, estimator, filter_value):
    cfg = make_cfg(adv_estimator=estimator, optim={"mini_batch_size": 16, "micro_batch_size": 16})
    steps, p0, p_final = _train_toy(name, Learner(tiny_policy(seed=1), cfg), 8, 4, filter_value)
    TOY_STEPS[name] = steps
    print(f"TOY {name}: p(good) {p0:.3f} -> {p_final:.3f} in {steps} steps")
    assert 0.3 < p0 < 0.7
    assert steps <= 60, f"{name} did not reach p(good) >= 0.9 in 60 steps (p={p_final:.3f})"


# ------------------------------------------------------------------------------------------ loading


def test_from_pretrained(tmp_path):
    tiny_policy(seed=3).save_pretrained(tmp_path / "model")
    learner = Learner.from_pretrained(tmp_path / "model", make_cfg(adv_estimator="grpo"))
    assert max_diff(weights(learner.policy), weights(tiny_policy(seed=3))) == 0.0
    assert math.isfinite(learner.step(random_batch(8))["actor/pg_loss"])


# ------------------------------------------------------------------------------------------ LoRA


def test_lora_trains_adapter_only_and_checkpoints(tmp_path):
    pytest.importorskip("peft")
    cfg = make_cfg(adv_estimator="grpo", use_kl_loss=True, kl_loss_coef=0.1)
    cfg.lora.rank, cfg.lora.alpha = 4, 8
    learner = Learner(tiny_policy(), cfg)
    assert learner.ref is None  # the reference is the adapter-disabled policy
    base_before = {k: v for k, v in weights(learner.policy).items() if "lora_" not in k}
    metrics = learner.step(random_batch(8))
    assert metrics["actor/kl_loss"] != 0.0
    after = weights(learner.policy)
    assert all(torch.equal(base_before[k], after[k]) for k in base_before)  # base frozen
    merged = learner.policy_state_dict()
    plain = tiny_policy().state_dict()
    assert merged.keys() == plain.keys()
    assert any(not torch.equal(merged[k], plain[k]) for k in plain)

    learner.save_checkpoint(tmp_path / "ckpt", iteration=3)
    assert (tmp_path / "ckpt" / "policy" / "adapter_model.safetensors").exists()
    fresh = Learner(tiny_policy(), cfg)
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert max_diff(weights(fresh.policy), after) == 0.0


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_advantage_scale_scales_the_advantages_and_the_policy_loss_only(estimator):
    """rollout.filter.loss_scaling reaches the learner as ``advantage_scale`` (RAGEN-2 multiplies
    the advantages after the estimator): advantages and the on-policy pg loss scale by it, returns do not."""
    batch = random_batch(8, seed=2)
    out = {}
    for scale in (1.0, 0.25):
        learner = Learner(
            tiny_policy(dtype=torch.float64), make_cfg(adv_estimator=estimator, optim={"mini_batch_size": 8})
        )
        out[scale] = learner.step(batch, advantage_scale=scale)
    for stat in ("mean", "max", "min"):
        assert out[0.25][f"critic/advantages/{stat}"] == pytest.approx(
            0.25 * out[1.0][f"critic/advantages/{stat}"]
        )
        assert out[0.25][f"critic/returns/{stat}"] == pytest.approx(out[1.0][f"critic/returns/{stat}"])
    # one mini-batch: the ratio is 1, nothing is clipped, so the pg loss is -mean(A) and scales exactly
    assert out[0.25]["actor/pg_loss"] == pytest.approx(0.25 * out[1.0]["actor/pg_loss"], rel=1e-9)
    assert out[1.0]["actor/pg_loss"] != 0.0


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_behaviour_logprobs_set_the_old_policy_of_the_ratio(estimator):
    """``behaviour_logprobs=True`` (trainer.off_policy_steps) takes the PPO ratio against the batch's
    rollout log-probs: the same step as recomputing them when they are the current policy's own, another
    one (ratio != 1 from the first mini-batch) when an older policy played the batch; a batch without
    them is refused before anything changes."""
    batch = random_batch(8, seed=4)
    cfg = make_cfg(adv_estimator=estimator)
    learner = Learner(tiny_policy(dtype=torch.float64), cfg)
    with torch.no_grad():
        own, _ = learner._logprobs(learner.policy, batch.input_ids, batch.loss_mask != 0)
    own_batch = _replace(batch, rollout_logprobs=own * batch.loss_mask)
    recomputed = Learner(tiny_policy(dtype=torch.float64), cfg)
    m_re = recomputed.step(own_batch)
    m_own = learner.step(own_batch, behaviour_logprobs=True)
    assert max_diff(weights(learner.policy), weights(recomputed.policy)) < 1e-9
    assert m_own["rollout/old_log_prob"] == pytest.approx(m_re["rollout/old_log_prob"], rel=1e-6)
    assert "timing_s/old_log_prob" in m_re and "timing_s/old_log_prob" not in m_own

    older = Learner(tiny_policy(dtype=torch.float64), cfg)
    stale = _replace(batch, rollout_logprobs=own_batch.rollout_logprobs - 0.1 * batch.loss_mask)
    metrics = older.step(stale, behaviour_logprobs=True)
    mask = batch.loss_mask != 0
    assert metrics["rollout/old_log_prob"] == pytest.approx(
        float(stale.rollout_logprobs[mask].mean()), rel=1e-9
    )
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.1, abs=0.02)  # mean(old - new) on the first pass
    assert max_diff(weights(older.policy), weights(recomputed.policy)) > 1e-6

    untouched = Learner(tiny_policy(dtype=torch.float64), cfg)
    before = weights(untouched.policy)
    with pytest.raises(ValueError, match=r"trainer\.off_policy_steps.*has none"):
        untouched.step(
            _replace(batch, rollout_logprobs=torch.zeros_like(batch.loss_mask)), behaviour_logprobs=True
        )
    assert max_diff(before, weights(untouched.policy)) == 0


def segmented_batch(policy: Qwen2ForCausalLM, n: int = 6, seed: int = 0) -> TokenBatch:
    """Rows of two or three sequences (``agent.window_training: every_turn``): each a shared 6-token
    opening, a few prompt tokens of its own and a 2-3 token answer, run from position 0; the rollout
    log-probs are the policy's own on each sequence alone."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, VOCAB, (6,), generator=g).tolist()
    rows, masks, turns, starts, lps = [], [], [], [], []
    for _ in range(n):
        ids: list[int] = []
        mask: list[int] = []
        turn: list[int] = []
        lp: list[float] = []
        row_starts = []
        for k in range(int(torch.randint(2, 4, (), generator=g))):
            own = torch.randint(1, VOCAB, (int(torch.randint(1, 4, (), generator=g)),), generator=g).tolist()
            answer = torch.randint(
                1, VOCAB, (int(torch.randint(2, 4, (), generator=g)),), generator=g
            ).tolist()
            seq = head + own + answer
            with torch.no_grad():
                out = policy(input_ids=torch.tensor([seq])).logits[0, :-1].float().log_softmax(-1)
            got = out.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
            row_starts.append(len(ids))
            ids += seq
            mask += [0] * (len(seq) - len(answer)) + [1] * len(answer)
            turn += [k] * len(seq)
            lp += [0.0] * (len(seq) - len(answer)) + got[-len(answer) :]
        rows.append(ids), masks.append(mask), turns.append(turn), starts.append(row_starts), lps.append(lp)
    width = max(len(r) for r in rows)

    def pad(x: list[list[float]], dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
        return torch.tensor([r + [fill] * (width - len(r)) for r in x], dtype=dtype)

    segments = [
        [k for k, (a, b) in enumerate(zip(s, [*s[1:], len(r)], strict=True)) for _ in range(b - a)]
        for s, r in zip(starts, rows, strict=True)
    ]
    return TokenBatch(
        input_ids=pad(rows, torch.long),
        attention_mask=pad([[1] * len(r) for r in rows], torch.long),
        loss_mask=pad(masks, torch.float32),
        turn_index=pad(turns, torch.long),
        rollout_logprobs=pad(lps, torch.float32),
        scores=torch.randn(n, generator=g),
        group_ids=torch.arange(n) // 3,
        segments=pad(segments, torch.long, -1),
    )


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_rows_trained_turn_by_turn_run_each_sequence_on_its_own(estimator):
    """A row of several sequences (each turn's own prompt and answer): the learner's old, reference and
    updated log-probs are those of each sequence alone (the rollout's), with a critic, a KL term, micro-
    batches and the shared opening; the same batch read as single sequences gives other log-probs."""
    policy = tiny_policy(dtype=torch.float64)
    batch = segmented_batch(policy)
    results = []
    for shared, micro in ((False, 2), (True, 2), (False, 6)):
        cfg = make_cfg(
            adv_estimator=estimator,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            optim={"mini_batch_size": 6, "micro_batch_size": micro, "old_logprobs_from_update": False},
        ).model_copy(update={"shared_prefix": shared})
        learner = Learner(tiny_policy(dtype=torch.float64), cfg)
        metrics = learner.step(batch)
        assert metrics["rollout/old_vs_rollout_logprob_max_diff"] < 1e-6, metrics
        results.append(weights(learner.policy))
    assert max(max_diff(results[0], w) for w in results[1:]) < 1e-6
    plain = Learner(
        tiny_policy(dtype=torch.float64), make_cfg(adv_estimator=estimator, optim={"mini_batch_size": 6})
    )
    merged = plain.step(_replace(batch, segments=None))
    assert merged["rollout/old_vs_rollout_logprob_max_diff"] > 1e-3
