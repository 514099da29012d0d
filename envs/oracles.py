"""One entry point to every environment's oracle: the actions a good player takes next.

The oracles feed the supervised warm start (demonstrations in exactly the rollout format), the
demo, and the tests. Each environment implements its own in :meth:`envs.base.Env.oracle_actions`
(built-in and plug-in alike); this entry point only applies the turn's action cap, so that every
caller gets at most what the protocol lets one turn execute.
"""

from __future__ import annotations

from envs.base import Env

__all__ = ["oracle_actions"]


def oracle_actions(env: Env, actions_left: int, max_actions: int = 5, turns_left: int = 1) -> list[str]:
    """The oracle's actions for the next turn (at most ``max_actions`` and ``actions_left``).

    Returns ``[]`` when the oracle knows no way to succeed (e.g. an unsolvable Sokoban position) or
    no action is left; free-text environments return one answer string. Raises
    :class:`~envs.base.NoOracleError` for an environment without an oracle.
    """
    n = max(0, min(max_actions, actions_left))
    if n == 0:
        return []
    return list(env.oracle_actions(actions_left, max_actions, turns_left))[:n]
