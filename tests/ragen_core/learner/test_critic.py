"""The critic: a separate copy of the policy's body or a head on the shared one, a seeded head."""

from __future__ import annotations

import torch

from ragen_core.config.learner import OptimConfig
from ragen_core.learner.critic import backbone, build_critic
from tests.ragen_core.learner.test_learner import random_batch, tiny_policy


def test_separate_critic_copies_the_policy_body():
    policy = tiny_policy()
    critic = build_critic(policy, OptimConfig(), seed=0)
    body = backbone(policy)
    assert critic.backbone is not body
    mine, theirs = critic.backbone.state_dict(), body.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = random_batch(2).input_ids
    assert critic(ids).shape == ids.shape  # one value per position


def test_shared_critic_trains_only_its_head():
    policy = tiny_policy()
    critic = build_critic(policy, OptimConfig(critic="shared_backbone"), seed=0)
    assert set(critic.state_dict()) == {"head.weight", "head.bias"}  # the body is not saved with it
    critic(random_batch(2).input_ids).sum().backward()
    assert all(p.grad is None for p in policy.parameters())  # the policy's features are detached
    assert critic.head.weight.grad is not None


def test_head_initialisation_is_seeded():
    heads = [build_critic(tiny_policy(), OptimConfig(), seed=s).head.weight for s in (3, 3, 4)]
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
