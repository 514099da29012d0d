"""The advantage estimators and policy losses the learner can use, by name (verl's registries).

A decorated function is the one place to add one::

    @register_adv_estimator("my_estimator", group_baseline=True, description="...")
    def my_estimator(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        ...  # (advantages, returns), each (B, T), zero outside x.mask

    @register_policy_loss("my_loss", description="...")
    def my_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ...  # (loss, {"clipfrac", "clipfrac_lower", "approx_kl"})

From then on ``learner.algorithm.adv_estimator: my_estimator`` (``policy_loss: my_loss``) is a valid
config value, the learner dispatches to it, and the docs table lists it (a test compares the two).
The built-ins are registered below. This module loads no torch (the tensor functions are imported
when an estimator runs): the config validates its names against these registries, and reading a
config loads no runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = [
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AdvantageSettings",
    "Entry",
    "PolicyLossInputs",
    "PolicyLossSettings",
    "Registry",
    "markdown_table",
    "register_adv_estimator",
    "register_policy_loss",
]

F = TypeVar("F", bound=Callable[..., object])


@dataclass(frozen=True)
class Entry(Generic[F]):
    """A registered function with what the rest of the pipeline needs to know about it.

    ``critic``: the estimator reads the critic's values (the learner builds and trains a critic);
    ``group_baseline``: its baseline is the trajectory's group (the config then needs groups of two or
    more); ``description``: one line for the docs table and the config's errors."""

    name: str
    fn: F
    description: str
    critic: bool = False
    group_baseline: bool = False


@dataclass
class Registry(Generic[F]):
    """Named functions of one kind; ``key`` is the config key that selects one."""

    key: str
    entries: dict[str, Entry[F]] = field(default_factory=dict)

    def register(
        self, name: str, *, description: str, critic: bool = False, group_baseline: bool = False
    ) -> Callable[[F], F]:
        """A decorator registering its function under ``name`` (refused when the name is taken)."""

        def add(fn: F) -> F:
            if name in self.entries:
                raise ValueError(
                    f"{self.key}: {name!r} is already registered (by {self.entries[name].fn.__module__}); "
                    "choose another name"
                )
            self.entries[name] = Entry(name, fn, description, critic, group_baseline)
            return fn

        return add

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> Entry[F]:
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(self.unknown(name))
        return entry

    def unknown(self, name: str) -> str:
        """The error for a name nothing registered: the known ones and how to add one."""
        return (
            f"{self.key}={name!r} is unknown; use one of {', '.join(self.names())} "
            "(or register one: ragen_core.algorithms.registry)"
        )

    @contextmanager
    def temporarily(self, name: str, fn: F, **traits: bool | str) -> Iterator[Entry[F]]:
        """Register ``fn`` as ``name`` inside the block only (tests; a plug-in registers for good)."""
        description = str(traits.pop("description", fn.__doc__ or name))
        self.register(name, description=description, **{k: bool(v) for k, v in traits.items()})(fn)
        try:
            yield self.entries[name]
        finally:
            del self.entries[name]


# --------------------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------------------


class AdvantageSettings(Protocol):
    """The ``learner.algorithm`` keys the built-in estimators read (``AlgorithmConfig`` has them)."""

    @property
    def gamma(self) -> float: ...
    @property
    def lam(self) -> float: ...
    @property
    def bi_level_gae(self) -> bool: ...
    @property
    def high_level_gamma(self) -> float: ...
    @property
    def whiten_advantages(self) -> bool: ...
    @property
    def kl_coef(self) -> float: ...
    @property
    def norm_adv_by_std(self) -> bool: ...


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator gets, per trained token (B, T) unless said otherwise, on the learner's device.

    ``token_rewards``: each row's rewards (already minus the in-reward KL penalty when configured);
    ``mask``: bool, the trained tokens; ``group_ids`` (B,): the rollout group of each row;
    ``values``: the critic's values before the update (only for an estimator registered with
    ``critic=True``); ``kl_in_reward``: the per-token in-reward KL (None when off);
    ``turn_rewards()``: each row's trained turns numbered 0, 1, ... (B, T) and each turn's reward
    (B, K), computed on demand; ``settings``: the ``learner.algorithm`` section."""

    token_rewards: torch.Tensor
    mask: torch.Tensor
    group_ids: torch.Tensor
    values: torch.Tensor | None
    kl_in_reward: torch.Tensor | None
    turn_rewards: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    settings: AdvantageSettings


AdvantageEstimator = Callable[[AdvantageInputs], "tuple[torch.Tensor, torch.Tensor]"]
#: ``learner.algorithm.adv_estimator``: name -> (advantages, returns) from :class:`AdvantageInputs`.
ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("learner.algorithm.adv_estimator")


def register_adv_estimator(
    name: str, *, description: str, critic: bool = False, group_baseline: bool = False
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register an advantage estimator: ``fn(AdvantageInputs) -> (advantages, returns)``."""
    return ADV_ESTIMATORS.register(
        name, description=description, critic=critic, group_baseline=group_baseline
    )


@register_adv_estimator(
    "gae",
    critic=True,
    description="PPO with a critic: GAE over the trained tokens (bi-level across turns with "
    "`bi_level_gae`), whitened with `whiten_advantages`",
)
def gae_advantages(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    from ragen_core.algorithms.advantages import bilevel_gae, gae, whiten

    s, mask = x.settings, x.mask
    if x.values is None:
        raise ValueError("the gae estimator needs the critic's values; the learner builds a critic for it")
    if s.bi_level_gae:
        turns, turn_rewards = x.turn_rewards()
        if x.kl_in_reward is not None:  # the in-reward KL of a turn's tokens is charged to that turn
            maskf = mask.to(x.token_rewards.dtype)
            turn_rewards = turn_rewards.scatter_add(1, turns, -s.kl_coef * x.kl_in_reward * maskf)
        adv, ret = bilevel_gae(turn_rewards, x.values, mask, turns, s.gamma, s.lam, s.high_level_gamma)
    else:
        adv, ret = gae(x.token_rewards, x.values, mask, s.gamma, s.lam)
    return (whiten(adv, mask) if s.whiten_advantages else adv), ret


@register_adv_estimator(
    "grpo",
    group_baseline=True,
    description="GRPO: the score minus its group's mean, over the group's std with `norm_adv_by_std`",
)
def grpo_advantages(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    from ragen_core.algorithms.advantages import grpo

    per_seq = grpo(x.token_rewards.sum(dim=1), x.group_ids, x.settings.norm_adv_by_std)
    adv = per_seq[:, None] * x.mask.to(x.token_rewards.dtype)
    return adv, adv


@register_adv_estimator(
    "rloo",
    group_baseline=True,
    description="RLOO: the score minus the mean of the other members of its group",
)
def rloo_advantages(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    from ragen_core.algorithms.advantages import rloo

    adv = rloo(x.token_rewards.sum(dim=1), x.group_ids)[:, None] * x.mask.to(x.token_rewards.dtype)
    return adv, adv


@register_adv_estimator(
    "reinforce_pp",
    description="REINFORCE++: discounted returns of the token rewards, whitened over the batch; no critic",
)
def reinforce_pp_advantages(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    from ragen_core.algorithms.advantages import reinforce_pp

    return reinforce_pp(x.token_rewards, x.mask, x.settings.gamma)


# --------------------------------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------------------------------


class PolicyLossSettings(Protocol):
    """The ``learner.algorithm`` keys the built-in policy loss reads (``AlgorithmConfig`` has them)."""

    @property
    def clip_low(self) -> float: ...
    @property
    def clip_high(self) -> float: ...
    @property
    def dual_clip(self) -> float | None: ...
    @property
    def loss_agg_mode(self) -> str: ...


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch, (b, t): ``logp`` the current log-probs (with their graph), ``old_logp`` those
    before the update, ``advantages``, ``mask`` the trained tokens; the mini-batch's global counts
    for the aggregation (``agg_loss``); ``settings`` the ``learner.algorithm`` section."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    global_token_count: torch.Tensor | float
    global_seq_count: torch.Tensor | float
    settings: PolicyLossSettings


PolicyLoss = Callable[[PolicyLossInputs], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
#: ``learner.algorithm.policy_loss``: name -> (loss, metrics ``clipfrac``, ``clipfrac_lower``,
#: ``approx_kl``, detached 0-dim tensors) from :class:`PolicyLossInputs`.
POLICY_LOSSES: Registry[PolicyLoss] = Registry("learner.algorithm.policy_loss")


def register_policy_loss(name: str, *, description: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss: ``fn(PolicyLossInputs) -> (loss, metrics)``."""
    return POLICY_LOSSES.register(name, description=description)


@register_policy_loss(
    "vanilla",
    description="PPO's clipped surrogate with clip-higher (`clip_low`, `clip_high`) and the dual clip "
    "for negative advantages (`dual_clip`)",
)
def vanilla_policy_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from ragen_core.algorithms.losses import policy_loss

    s = x.settings
    return policy_loss(
        x.logp,
        x.old_logp,
        x.advantages,
        x.mask,
        clip_low=s.clip_low,
        clip_high=s.clip_high,
        dual_clip=s.dual_clip,
        agg=s.loss_agg_mode,
        global_token_count=x.global_token_count,
        global_seq_count=x.global_seq_count,
    )


def markdown_table() -> str:
    """The registered estimators and policy losses as the docs table (docs/architecture.md, "Advantage
    estimators and policy losses"; a test checks that the page holds it as printed here)."""
    rows = [
        "| config key | name | function | critic | group baseline | what |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for registry in (ADV_ESTIMATORS, POLICY_LOSSES):
        for e in registry.entries.values():
            flags = " | ".join("yes" if flag else "no" for flag in (e.critic, e.group_baseline))
            where = f"{e.fn.__module__}.{e.fn.__name__}"
            rows.append(f"| `{registry.key}` | `{e.name}` | `{where}` | {flags} | {e.description} |")
    return "\n".join(rows)
