"""One entry point to every environment's oracle: the actions a good player takes next.

The oracles feed the supervised warm start (demonstrations in exactly the rollout format), the
demo, and the tests. Deterministic environments get a shortest plan; FrozenLake is stochastic, so
its oracle is a closed-loop policy and a turn's actions are the policy followed along the intended
(non-slip) moves, spread evenly over the remaining turns so that the whole budget can be used.
Plug-in environments provide a method ``oracle_actions(actions_left, max_actions, turns_left)``.
"""

from __future__ import annotations

import math

from envs.base import Env


class NoOracleError(NotImplementedError):
    """The environment has no oracle."""


def oracle_actions(env: Env, actions_left: int, max_actions: int = 5, turns_left: int = 1) -> list[str]:
    """The oracle's actions for the next turn (at most ``max_actions`` and ``actions_left``).

    Returns ``[]`` when the oracle knows no way to succeed (e.g. an unsolvable Sokoban position);
    free-text environments return one answer string.
    """
    n = max(0, min(max_actions, actions_left))
    if n == 0:
        return []
    custom = getattr(env, "oracle_actions", None)
    if callable(custom):
        return list(custom(actions_left, max_actions, turns_left))[:n]
    kind = type(env).env_type or type(env).__name__
    if kind == "bandit":
        return [env.oracle_action()]  # type: ignore[attr-defined]
    if kind == "sokoban":
        from envs.sokoban_solver import solve

        plan = solve(env, max_depth=actions_left)
        return (plan or [])[:n]
    if kind == "frozen_lake":
        return _frozen_lake_turn(env, actions_left, math.ceil(actions_left / max(turns_left, 1)), n)
    if kind == "countdown":
        sol = env.solution  # type: ignore[attr-defined]
        return [sol] if sol else []
    if kind == "metamathqa":
        from envs.mathqa import solve as gold

        return [gold(env)]  # type: ignore[arg-type]
    raise NoOracleError(f"environment type {kind!r} has no oracle; define oracle_actions() on it")


def _frozen_lake_turn(env: Env, actions_left: int, per_turn: int, cap: int) -> list[str]:
    from envs.frozen_lake import ACTIONS, build_transitions, optimal_policy, policy_action

    table, _ = optimal_policy(env, horizon=max(actions_left, 1))  # type: ignore[arg-type]
    intended = build_transitions(env.desc, is_slippery=False)  # type: ignore[attr-defined]
    state, out = env.state, []  # type: ignore[attr-defined]
    for k in range(min(per_turn, cap)):
        a = policy_action(table, state, actions_left - k)
        out.append(ACTIONS[a])
        _, state, _, terminal = intended[state][a][0]
        if terminal:
            break
    return out
