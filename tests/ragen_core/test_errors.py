"""Classifying exceptions: which say a Ray actor or node was lost (a rebuild can help), by name and
through the chain of causes, without importing Ray."""

from __future__ import annotations

from ragen_core.errors import ray_actor_lost


class ActorDiedError(RuntimeError):  # named as Ray's: classification is by name
    pass


class NodeDiedError(ActorDiedError):
    pass


def test_a_lost_actor_is_recognised_by_name_subclass_and_cause() -> None:
    assert ray_actor_lost(ActorDiedError("gone"))
    assert ray_actor_lost(NodeDiedError("node gone"))
    try:
        try:
            raise ActorDiedError("rank 1")
        except ActorDiedError as lost:
            raise RuntimeError("Connection closed by peer") from lost
    except RuntimeError as collective:
        assert ray_actor_lost(collective)  # the collective's failure, raised from the loss
    assert not ray_actor_lost(RuntimeError("Connection closed by peer"))
    assert not ray_actor_lost(ValueError("a config error"))
