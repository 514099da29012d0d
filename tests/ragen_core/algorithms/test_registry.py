"""The registries of advantage estimators and policy losses: a decorated function is the one place to
add one (the config accepts it, the learner calls it, the docs table lists the built-ins)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragen_core.algorithms import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossInputs,
    grpo,
    register_adv_estimator,
)
from ragen_core.algorithms.registry import markdown_table, vanilla_policy_loss
from ragen_core.config import ConfigError, load_config
from ragen_core.learner.update import Learner
from tests.ragen_core.learner.test_learner import make_cfg, random_batch, tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["train.n_groups=[8]", "train.group_size=4", "learner.optim.mini_batch_size=4"]


def test_the_docs_table_is_the_registries() -> None:
    """docs/architecture.md lists exactly what is registered (regenerate: registry.markdown_table())."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert markdown_table() in page, "docs/architecture.md's table differs from registry.markdown_table()"
    assert set(ADV_ESTIMATORS.names()) == {"gae", "grpo", "rloo", "reinforce_pp"}
    assert set(POLICY_LOSSES.names()) == {"vanilla"}


def test_unknown_and_taken_names_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"adv_estimator='ppo' is unknown; use one of gae, grpo, rloo"):
        load_config(overrides=["learner.algorithm.adv_estimator=ppo"])
    with pytest.raises(ConfigError, match=r"policy_loss='gspo' is unknown; use one of vanilla"):
        load_config(overrides=["learner.algorithm.policy_loss=gspo"])
    with pytest.raises(ValueError, match=r"'grpo' is already registered"):
        register_adv_estimator("grpo", description="again")(lambda x: (x.token_rewards, x.token_rewards))


def test_a_registered_estimator_is_usable_from_a_config_without_other_edits() -> None:
    """One decorated function: the config accepts its name, its traits drive the config's checks and
    the critic, and the learner's step calls it."""
    calls: list[AdvantageInputs] = []

    def half_grpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """GRPO's advantages halved."""
        calls.append(x)
        adv = 0.5 * grpo(x.token_rewards.sum(dim=1), x.group_ids)[:, None] * x.mask.to(x.token_rewards.dtype)
        return adv, adv

    with ADV_ESTIMATORS.temporarily("half_grpo", half_grpo, group_baseline=True):
        cfg = load_config(overrides=[*SMALL, "learner.algorithm.adv_estimator=half_grpo"])
        assert cfg.learner.algorithm.adv_estimator == "half_grpo" and not cfg.learner.algorithm.use_critic
        with pytest.raises(ConfigError, match=r"adv_estimator=half_grpo needs train\.group_size>=2"):
            load_config(
                overrides=[
                    *SMALL,
                    "learner.algorithm.adv_estimator=half_grpo",
                    "train.group_size=1",
                    "rollout.filter.value=1",
                ]
            )
        learner = Learner(tiny_policy(), make_cfg(adv_estimator="half_grpo"))
        assert learner.critic is None
        metrics = learner.step(random_batch())
        assert len(calls) == 1 and calls[0].values is None
        reference = Learner(tiny_policy(), make_cfg(adv_estimator="grpo")).step(random_batch())
        assert metrics["critic/advantages/max"] == pytest.approx(0.5 * reference["critic/advantages/max"])
    with pytest.raises(ConfigError, match=r"adv_estimator='half_grpo' is unknown"):  # gone again
        load_config(overrides=[*SMALL, "learner.algorithm.adv_estimator=half_grpo"])


def test_a_registered_estimator_with_a_critic_gets_one() -> None:
    def value_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.values is not None  # the learner computed the critic's values for it
        returns = x.token_rewards.flip(1).cumsum(1).flip(1) * x.mask
        return (returns - x.values) * x.mask, returns

    with ADV_ESTIMATORS.temporarily("value_baseline", value_baseline, critic=True):
        assert load_config(
            overrides=["learner.algorithm.adv_estimator=value_baseline"]
        ).learner.algorithm.use_critic
        learner = Learner(tiny_policy(), make_cfg(adv_estimator="value_baseline"))
        assert learner.critic is not None
        metrics = learner.step(random_batch())
        assert "critic/vf_loss" in metrics and "critic/values/mean" in metrics


def test_a_registered_policy_loss_is_what_the_actor_update_uses() -> None:
    calls: list[PolicyLossInputs] = []

    def doubled(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Twice the vanilla loss."""
        calls.append(x)
        loss, metrics = vanilla_policy_loss(x)
        return 2 * loss, metrics

    with POLICY_LOSSES.temporarily("doubled", doubled):
        assert load_config(
            overrides=["learner.algorithm.policy_loss=doubled"]
        ).learner.algorithm.policy_loss == ("doubled")
        one_update = {"mini_batch_size": 8}  # the loss of the first update only: exactly twice
        learner = Learner(
            tiny_policy(), make_cfg(adv_estimator="grpo", policy_loss="doubled", optim=one_update)
        )
        metrics = learner.step(random_batch())
    reference = Learner(tiny_policy(), make_cfg(adv_estimator="grpo", optim=one_update)).step(random_batch())
    assert calls and all(c.settings.clip_high == 0.28 for c in calls)
    assert metrics["actor/pg_loss"] == pytest.approx(2 * reference["actor/pg_loss"])
