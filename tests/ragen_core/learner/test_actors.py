"""Ray learner actors: data parallelism over 2 actors (gloo) equals 1 learner; checkpoints through the group."""

from __future__ import annotations

import functools

import pytest
import ray
import torch
from transformers import Qwen2ForCausalLM

from ragen_core.learner.actors import LearnerGroup, init_ray
from ragen_core.learner.batch import BadBatchError
from ragen_core.learner.update import Learner
from tests.ragen_core.learner.test_learner import make_cfg, max_diff, random_batch, tiny_policy

# Two epochs x two mini-batches (4 optimiser steps), one sequence per micro-batch, every loss term on.
#: end-to-end runs (servers, subprocesses, training): `make test` runs them, `make test-fast` does not
pytestmark = pytest.mark.slow


CFG = make_cfg(
    use_kl_loss=True, kl_loss_coef=0.05, optim={"mini_batch_size": 4, "micro_batch_size": 1, "ppo_epochs": 2}
)


@pytest.fixture(scope="module")
def ray_cluster():
    # 2 actors + a spare. An in-process run of an earlier module on this pytest worker may have left its
    # own cluster up (init_ray starts one per process, sized to the machine: 2 CPUs here), and the third
    # actor would then wait for a free CPU: which modules share a worker depends on timing.
    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < 4:
        ray.shutdown()
    started = not ray.is_initialized()
    init_ray(num_cpus=4, object_store_memory=256 * 1024**2)
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


def _adam_moments(path) -> dict[str, torch.Tensor]:
    """The optimisers' per-parameter state of a checkpoint (``optim.pt``), keyed by optimiser/param/name."""
    state = torch.load(path / "optim.pt", weights_only=False)
    return {
        f"{opt}/{param}/{name}": value
        for opt in ("actor_optim", "critic_optim")
        if state[opt] is not None
        for param, per_param in state[opt]["state"].items()
        for name, value in per_param.items()
    }


def test_a_checkpoint_resumes_with_another_number_of_learners(ray_cluster, factory, group2, tmp_path):
    """Elastic resume (trainer.learners may change on resume): a checkpoint written by 2 learners
    resumes on 1 and one written by 1 resumes on 2, optimiser state included, and two more steps land
    where an uninterrupted single learner lands (float64: only the all-reduce's summation order
    differs, so equal within 1e-9, not bitwise). Without the optimiser state they would not."""
    batches = [random_batch(8, seed=s) for s in (11, 12, 13)]
    start = Learner(factory(), CFG)
    start.save_checkpoint(tmp_path / "start", 0)
    uninterrupted = Learner(factory(), CFG)
    for batch in batches:
        uninterrupted.step(batch)
    uninterrupted.save_checkpoint(tmp_path / "uninterrupted", 3)

    # 2 -> 1: the two-actor group takes the first step, a single learner the other two
    group2.load_checkpoint(tmp_path / "start")
    group2.step(batches[0])
    group2.save_checkpoint(tmp_path / "two", 1)
    one = Learner(tiny_policy(seed=0, dtype=torch.float64), CFG)
    one.load_checkpoint(tmp_path / "two")
    for batch in batches[1:]:
        one.step(batch)
    one.save_checkpoint(tmp_path / "two-then-one", 3)

    # 1 -> 2: a single learner takes the first step, the two-actor group the other two
    first = Learner(factory(), CFG)
    first.step(batches[0])
    first.save_checkpoint(tmp_path / "one", 1)
    group2.load_checkpoint(tmp_path / "one")
    for batch in batches[1:]:
        group2.step(batch)
    group2.save_checkpoint(tmp_path / "one-then-two", 3)

    want = uninterrupted.policy.state_dict()
    want_moments = _adam_moments(tmp_path / "uninterrupted")
    for name in ("two-then-one", "one-then-two"):
        got = Learner(tiny_policy(seed=0, dtype=torch.float64), CFG)
        info = got.load_checkpoint(tmp_path / name)
        assert info["global_step"] == uninterrupted.global_step, name
        assert max_diff(want, got.policy.state_dict()) < 1e-9, name
        moments = _adam_moments(tmp_path / name)
        assert moments.keys() == want_moments.keys() and len(moments) > 0, name
        assert max(float((moments[k] - want_moments[k]).abs().max()) for k in moments) < 1e-9, name

    # what the comparison catches: the same two steps from the same checkpoint with the optimiser
    # state dropped (as a resharding that keeps only the weights does)
    dropped = Learner(tiny_policy(seed=0, dtype=torch.float64), CFG)
    dropped.load_checkpoint(tmp_path / "two")
    for optim in (dropped.actor_optim, dropped.critic_optim):
        if optim is not None:
            optim.state.clear()
    for batch in batches[1:]:
        dropped.step(batch)
    assert max_diff(want, dropped.policy.state_dict()) > 1e-6
