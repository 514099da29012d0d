"""The learner's config: RAGEN's defaults, and errors that name the key."""

from __future__ import annotations

import pytest

from ragen_core.config.learner import AlgorithmConfig, LearnerConfig, OptimConfig


def test_config_defaults_match_spec():
    cfg = LearnerConfig()
    a, o = cfg.algorithm, cfg.optim
    assert (a.adv_estimator, a.gamma, a.lam, a.bi_level_gae, a.high_level_gamma) == (
        "gae",
        1.0,
        1.0,
        False,
        0.95,
    )
    assert (a.clip_low, a.clip_high, a.dual_clip, a.value_clip) == (0.2, 0.28, 3.0, 0.5)
    assert (a.loss_agg_mode, a.entropy_coeff, a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type) == (
        "token-mean",
        0.001,
        False,
        0.0,
        "k1",
    )
    assert (a.use_kl_in_reward, a.kl_coef, a.norm_adv_by_std, a.whiten_advantages) == (False, 0.0, True, True)
    assert (o.actor_lr, o.critic_lr, o.weight_decay, o.betas, o.grad_clip) == (
        1e-6,
        1e-5,
        0.01,
        (0.9, 0.999),
        1.0,
    )
    assert (o.ppo_epochs, o.mini_batch_size, o.micro_batch_size, o.critic) == (1, 32, 4, "separate")
    assert (cfg.num_gpus, cfg.num_cpus, cfg.bf16_autocast_on_gpu) == (0, 1, True)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="extra"):
        LearnerConfig.model_validate({"optim": {"mini_batchsize": 3}})
    with pytest.raises(ValueError, match="bi_level_gae"):
        AlgorithmConfig(adv_estimator="grpo", bi_level_gae=True)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        AlgorithmConfig(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="micro_batch_size"):
        OptimConfig(micro_batch_size=0)


def test_ragen2_options_default_to_todays_behaviour():
    a = AlgorithmConfig()
    assert (a.reward_normalization.grouping, a.reward_normalization.method) == ("state", "identity")
    assert not a.reward_normalization.active
    assert (a.use_turn_scores, a.soft_advantage_reweight, a.grpo_advantage_length_weight) == (
        False,
        False,
        False,
    )
    assert a.zero_task_advantage is False


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"soft_advantage_reweight": True},
            r"algorithm\.soft_advantage_reweight=true needs algorithm\.adv_estimator=grpo \(got 'gae'\)",
        ),
        (
            {"adv_estimator": "rloo", "grpo_advantage_length_weight": True},
            r"grpo_advantage_length_weight=true needs algorithm\.adv_estimator=grpo \(got 'rloo'\)",
        ),
        (
            {"reward_normalization": {"method": "mean_std"}, "use_turn_scores": True},
            r"reward_normalization\.method='mean_std' normalises trajectory scores.*use_turn_scores false",
        ),
        (
            {"reward_normalization": {"method": "asym_clip"}, "bi_level_gae": True},
            r"reward_normalization\.method='asym_clip'.*bi_level_gae false",
        ),
        ({"reward_normalization": {"grouping": "tag"}}, "grouping"),
        ({"reward_normalization": {"method": "z"}}, "method"),
    ],
)
def test_ragen2_options_mixed_wrongly_name_the_key_and_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig.model_validate(fields)


def test_ragen2_options_that_fit_together_load():
    AlgorithmConfig(
        adv_estimator="grpo",
        soft_advantage_reweight=True,
        grpo_advantage_length_weight=True,
        reward_normalization={"grouping": "inductive", "method": "asym_clip"},
        zero_task_advantage=True,
    )
    AlgorithmConfig(bi_level_gae=True, use_turn_scores=True)  # bi-level reads turn scores anyway
