"""The names the algorithms accept (the config's allowed values) and the filter's group-count rule, in
plain Python: the config checks a run's settings with them without loading torch. The algorithms
(``ragen_core.algorithms``) import them from here and re-export them."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Canonical KL estimator names and the veRL aliases accepted for them.
KL_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}

#: Every metric, in RAGEN-2's spelling.
FILTER_METRICS = ("reward_variance", "reward", "reward_sum", "entropy", "entropy_variance", "length")
#: The metrics read from the token tensors (log-probs and loss mask) rather than the scores.
TOKEN_FILTER_METRICS = ("entropy", "entropy_variance", "length")
#: The metrics that are an in-group spread: undefined (NaN) for a group of one trajectory.
SPREAD_FILTER_METRICS = ("reward_variance", "entropy_variance")


def kept_group_count(ratio: float, n_groups: int) -> int:
    """How many of ``n_groups`` groups the filter keeps at ``ratio``: the one rounding rule.

        k = max(1, round_half_up(ratio · G))     (0.25·8 = 2, 0.5·5 = 3, 0.58·25 = 15)

    The product is taken in decimal, as the ratio is written (``0.58``), not in binary floating
    point, where 0.58·25 = 14.499999999999998 would round down. ``n_groups == 0`` keeps 0.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(
            f"the kept fraction of the groups (rollout.filter.value) must be in (0, 1], got {ratio}"
        )
    if n_groups <= 0:
        return 0
    exact = Decimal(repr(float(ratio))) * n_groups
    return max(1, int(exact.to_integral_value(rounding=ROUND_HALF_UP)))
