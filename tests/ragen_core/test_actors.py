"""Ray learner actors: data parallelism over 2 actors (gloo) equals 1 learner; checkpoints through the group."""

from __future__ import annotations

import functools

import pytest
import ray
import torch
from transformers import Qwen2ForCausalLM

from ragen_core.actors import LearnerGroup, init_ray
from ragen_core.learner import BadBatchError, Learner
from tests.ragen_core.test_learner import make_cfg, max_diff, random_batch, tiny_policy

# Two epochs x two mini-batches (4 optimiser steps), one sequence per micro-batch, every loss term on.
#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


CFG = make_cfg(
    use_kl_loss=True, kl_loss_coef=0.05, optim={"mini_batch_size": 4, "micro_batch_size": 1, "ppo_epochs": 2}
)


@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    init_ray(num_cpus=4, object_store_memory=256 * 1024**2)  # logical CPUs: 2 actors + a spare
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    """Float64 weights, so that the comparison shows the algorithm, not float32 summation order."""
    path = tmp_path_factory.mktemp("policy")
    tiny_policy(seed=5).save_pretrained(path)
    return functools.partial(Qwen2ForCausalLM.from_pretrained, str(path), dtype=torch.float64)


@pytest.fixture(scope="module")
def group2(ray_cluster, factory):
    with LearnerGroup(CFG, factory, world_size=2) as group:
        yield group


def test_two_learner_actors_equal_one_learner(ray_cluster, factory, group2, tmp_path):
    batch = random_batch(8, seed=4)
    local = Learner(factory(), CFG)
    local_metrics = local.step(batch)
    local_w = {k: v.clone() for k, v in local.policy.state_dict().items()}
    with LearnerGroup(CFG, factory, world_size=1) as one:
        m1 = one.step(batch)
        w1 = one.get_weights()
    m2 = group2.step(batch)
    w2 = group2.get_weights()

    diff_dp, diff_local = max_diff(w1, w2), max_diff(w1, local_w)
    print(
        f"DP max |w(2 actors) - w(1 actor)| = {diff_dp:.3g}; 1 actor vs in-process learner {diff_local:.3g}"
    )
    assert diff_dp < 1e-9 and diff_local < 1e-12
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "actor/kl_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "critic/vf_loss",
        "critic/grad_norm",
        "critic/vpred_mean",
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-8, abs=1e-12), key
        assert m1[key] == pytest.approx(local_metrics[key], rel=1e-8, abs=1e-12), key

    # a checkpoint written by the 2-actor group loads back into it and into a plain learner
    group2.save_checkpoint(tmp_path / "ckpt", iteration=7, extra={"who": "dp"})
    info = group2.load_checkpoint(tmp_path / "ckpt")
    assert info["iteration"] == 7 and info["extra"] == {"who": "dp"}
    resumed = Learner(tiny_policy(seed=0, dtype=torch.float64), CFG)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert max_diff(w2, resumed.policy.state_dict()) == 0.0


def test_group_refuses_bad_batches_and_stays_usable(group2):
    with pytest.raises(BadBatchError, match=r"optim\.mini_batch_size=4 .* 3 trajectories"):
        group2.step(random_batch(3))
    metrics = group2.step(random_batch(6, seed=3))  # 6 rows: 1 mini-batch, uneven shards (3 + 3)
    assert metrics["actor/skipped_steps"] == 0
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
