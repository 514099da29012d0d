"""Env groups: the P x N environment instances of a rollout and their episode bookkeeping.

This is RAGEN's ``es_manager`` (docs/architecture.md, "Env groups and seeds" and "Agent text
protocol"): P groups ("initial states"), N rollouts per group sharing the group's seed, per-episode
action budget, format penalty, termination, and the per-tag metrics. It is text only: a rollout
runner (text or token level) asks for each live env's prompt (:meth:`EnvGroups.messages`, or the
protocol pieces over :meth:`EnvGroups.history`), samples, and hands the replies back to
:meth:`EnvGroups.step`. Instances are built once and re-seeded at every :meth:`EnvGroups.reset`, as
in RAGEN.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

import envs
from envs.base import Env
from envs.registry import EnvSpec
from ragen_core.protocol import (
    Message,
    ParsedResponse,
    ProtocolConfig,
    TurnRecord,
    build_messages,
    instruction_prefix,
    parse_response,
)

__all__ = [
    "DEFAULT_SEEDS",
    "EnvGroups",
    "EnvGroupsConfig",
    "EpisodeSummary",
    "GroupsConfig",
    "Mode",
    "RemoteEnvConfig",
    "StepOutcome",
]

Mode = Literal["train", "val"]

#: RAGEN's ``seed.train`` / ``seed.val``: train and val initial states never overlap.
DEFAULT_SEEDS: dict[str, int] = {"train": 10000, "val": 123}

#: Info keys every tag reports (0 when an env never produced them).
_CORE_INFO_KEYS = ("action_is_valid", "action_is_effective")


class RemoteEnvConfig(BaseModel):
    """A tag played on a server (docs/environments.md, "Environments over the wire")."""

    model_config = ConfigDict(extra="forbid")

    url: str  # ws://host:port (http:// works too)
    protocol: Literal["openenv"] = "openenv"
    timeout_s: float = Field(default=30.0, gt=0)  # for one answer; a slower server counts as lost
    connect_timeout_s: float = Field(default=5.0, gt=0)
    retries: int = Field(default=2, ge=0)  # reconnects (each replays the episode) before the rollout fails
    max_observation_bytes: int = Field(default=1_000_000, ge=1024)
    action_field: str = "message"  # the text field of the server's action
    observation_field: str = "text"  # the text field of its observation
    token_env: str | None = None  # name of the environment variable holding the server's token

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.startswith(("ws://", "wss://", "http://", "https://")):
            raise ValueError(f"remote url {v!r} must start with ws://, wss://, http:// or https://")
        return v

    def token(self) -> str | None:
        if self.token_env is None:
            return None
        value = os.environ.get(self.token_env)
        if not value:
            raise ValueError(
                f"remote token_env={self.token_env!r}: that environment variable is not set; export the "
                "server's token in it"
            )
        return value


class EnvGroupsConfig(BaseModel):
    """Which envs one rollout batch holds (RAGEN's ``es_manager.train`` / ``es_manager.val``).

    ``n_groups[j]`` groups of tag ``tags[j]``, ``group_size`` rollouts per group. ``seed`` is the
    base seed; ``None`` uses the mode's default (train 10000, val 123).
    """

    model_config = ConfigDict(extra="forbid")

    tags: list[str] = ["SimpleSokoban"]
    n_groups: list[int] = [8]
    group_size: int = 16
    env_groups: int | None = None  # optional cross-check: must equal sum(n_groups)
    seed: int | None = None
    env_overrides: dict[str, dict[str, Any]] = {}  # tag -> env_config overrides for envs.make
    remote: dict[str, RemoteEnvConfig] = {}  # tag -> the server that plays it instead of this process

    @field_validator("group_size")
    @classmethod
    def _check_group_size(cls, v: int) -> int:
        if v < 1:
            raise ValueError("group_size must be >= 1")
        return v

    @field_validator("n_groups")
    @classmethod
    def _check_n_groups(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v):
            raise ValueError(f"every n_groups entry must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _check_lengths(self) -> EnvGroupsConfig:
        if not self.tags:
            raise ValueError("tags must name at least one environment tag")
        if len(self.tags) != len(self.n_groups):
            raise ValueError(
                f"tags ({len(self.tags)}) and n_groups ({len(self.n_groups)}) must have the same length: "
                "one group count per tag"
            )
        if self.env_groups is not None and self.env_groups != sum(self.n_groups):
            raise ValueError(f"env_groups={self.env_groups} but sum(n_groups)={sum(self.n_groups)}")
        unknown = set(self.env_overrides) - set(self.tags)
        if unknown:
            raise ValueError(f"env_overrides for tags not in tags: {sorted(unknown)}")
        unknown = set(self.remote) - set(self.tags)
        if unknown:
            raise ValueError(f"remote for tags not in tags: {sorted(unknown)}")
        return self

    @property
    def num_groups(self) -> int:
        """P, the number of distinct initial states per reset."""
        return sum(self.n_groups)

    @property
    def num_envs(self) -> int:
        """P x N."""
        return self.num_groups * self.group_size

    def base_seed(self, mode: Mode) -> int:
        return self.seed if self.seed is not None else DEFAULT_SEEDS[mode]


GroupsConfig = EnvGroupsConfig  # short alias


@dataclass
class StepOutcome:
    """What one turn did to one env."""

    env_id: int
    turn: int  # 1-based index of the turn just played
    parsed: ParsedResponse
    actions: list[str]  # executed actions (after budget truncation and the stop at done)
    reward: float  # turn env reward
    penalty: float  # format penalty charged this turn
    info: dict[str, Any]
    done: bool  # the episode is over (for any reason)
    success: bool
    actions_left: int
    end_reason: str | None  # "done" | "budget" | "max_turn" | None


@dataclass
class EpisodeSummary:
    """One env's episode, for the trajectory table and the metrics."""

    env_id: int
    group_id: int
    tag: str
    seed: int
    turns: int
    success: bool
    terminated: bool  # the env itself ended the episode (done)
    truncated: bool  # ended by the action budget or max_turn instead
    end_reason: str | None
    reward: float  # sum of turn env rewards
    format_penalty: float  # sum of turn penalties (<= 0)
    score: float  # reward + format_penalty: what the learner optimises
    num_actions: int
    actions: list[list[str]]
    turn_rewards: list[float]
    turn_penalties: list[float]
    infos: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _EnvState:
    env_id: int
    group_id: int
    tag: str
    env: Env
    spec: EnvSpec
    seed: int = -1
    prefix: str = ""
    history: list[TurnRecord] = field(default_factory=list)
    actions_left: int = 0
    num_actions: int = 0
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    success: bool = False
    end_reason: str | None = None


def _as_number(v: Any) -> float | None:
    """``float(v)`` for bools and numbers (numpy scalars included); ``None`` for anything else."""
    if isinstance(v, str | bytes) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _default_make(tag: str, **overrides: Any) -> Env:
    return envs.make(tag, **overrides)


def remote_maker(tag: str, remote: RemoteEnvConfig, overrides: dict[str, Any]) -> Callable[[], Env]:
    """Builds sessions of ``remote`` playing ``tag``: the server is asked once what it plays (down, or
    other settings than ``overrides``: one error, before any episode), then each call opens a session."""
    from envs.wire.client import RemoteEnv, check_action_field, check_settings, probe

    token = remote.token()
    info = probe(remote.url, token, remote.connect_timeout_s, tag)
    try:
        local = envs.spec(tag, **overrides)
    except envs.UnknownEnvError:
        local = None  # a tag of the server only: its spec comes from the server
    expected = local.env_config if local is not None else dict(overrides)
    check_action_field(info, remote.action_field)
    check_settings(info, tag, expected)

    def make() -> Env:
        return RemoteEnv(
            remote.url,
            tag=tag,
            timeout_s=remote.timeout_s,
            connect_timeout_s=remote.connect_timeout_s,
            retries=remote.retries,
            max_observation_bytes=remote.max_observation_bytes,
            action_field=remote.action_field,
            observation_field=remote.observation_field,
            token=token,
            env_config=expected,
            spec=local,
            info=info,
        )

    return make


class EnvGroups:
    """P x N env instances, laid out contiguously by tag; ``group_id = env_id // group_size``.

    ``make_env(tag, **overrides)`` builds one instance (default :func:`envs.make`); the instance
    should carry ``.spec`` (an :class:`~envs.registry.EnvSpec`), else the catalogue's spec is used.
    """

    def __init__(
        self,
        config: EnvGroupsConfig,
        protocol_cfg: ProtocolConfig | None = None,
        mode: Mode = "train",
        make_env: Callable[..., Env] | None = None,
    ) -> None:
        if mode not in DEFAULT_SEEDS:
            raise ValueError(f"mode must be 'train' or 'val', got {mode!r}")
        self.config = config
        self.protocol = protocol_cfg or ProtocolConfig()
        self.mode: Mode = mode
        self.group_size = config.group_size
        self.num_groups = config.num_groups
        self._make = make_env or _default_make
        self._resets = 0  # RAGEN's counter: the next implicit train reset index
        self._states: list[_EnvState] = []
        env_id = 0
        for tag, n in zip(config.tags, config.n_groups, strict=True):
            overrides = config.env_overrides.get(tag, {})
            remote = config.remote.get(tag)
            make_remote = remote_maker(tag, remote, overrides) if remote is not None else None
            for _ in range(n * self.group_size):
                env = make_remote() if make_remote is not None else self._make(tag, **overrides)
                spec = getattr(env, "spec", None)
                if not isinstance(spec, EnvSpec):
                    spec = envs.spec(tag, **overrides)
                if self.protocol.max_actions_per_traj is not None:
                    spec = replace(spec, max_actions_per_traj=self.protocol.max_actions_per_traj)
                self._states.append(
                    _EnvState(env_id=env_id, group_id=env_id // self.group_size, tag=tag, env=env, spec=spec)
                )
                env_id += 1
        self._reset_done = False

    # ------------------------------------------------------------------ layout
    def __len__(self) -> int:
        return len(self._states)

    @property
    def env_ids(self) -> list[int]:
        return list(range(len(self._states)))

    def tag(self, env_id: int) -> str:
        return self._states[env_id].tag

    def group_id(self, env_id: int) -> int:
        return self._states[env_id].group_id

    def env(self, env_id: int) -> Env:
        return self._states[env_id].env

    def spec(self, env_id: int) -> EnvSpec:
        return self._states[env_id].spec

    def max_tokens(self, env_id: int) -> int:
        return self._states[env_id].spec.max_tokens

    def prefix(self, env_id: int) -> str:
        """The env's instruction prefix (recomputed at each reset: vocabularies may follow the seed)."""
        return self._states[env_id].prefix

    def history(self, env_id: int) -> list[TurnRecord]:
        """The env's turn records (the live list: do not mutate)."""
        return self._states[env_id].history

    def seeds_for(self, seed_round: int | None = None) -> list[int]:
        """Per-env seeds of a reset (docs/architecture.md, "Env groups and seeds"), without resetting.

        train: group ``i`` gets ``base + seed_round * P + i`` (iteration ``k`` plays round ``k - 1``);
        val: always ``base + i``. All N members of a group share the seed.
        """
        base = self.config.base_seed(self.mode)
        if self.mode == "val":
            offset = 0
        else:
            r = self._resets if seed_round is None else seed_round
            if r < 0:
                raise ValueError(f"seed_round must be >= 0, got {r}")
            offset = r * self.num_groups
        return [base + offset + s.group_id for s in self._states]

    # ------------------------------------------------------------------ episode
    def reset(self, seed_round: int | None = None) -> list[int]:
        """Start new episodes in every env; returns the seed of each env (by env_id).

        ``seed_round`` (0-based: iteration ``k`` plays round ``k - 1``) picks the train seeds;
        ``None`` continues RAGEN's counter (which an explicit round re-aligns). Val ignores it.
        """
        seeds = self.seeds_for(seed_round)
        if self.mode == "train":
            self._resets = (self._resets if seed_round is None else seed_round) + 1
        for st, seed in zip(self._states, seeds, strict=True):
            state = st.env.reset(seed)
            st.seed = seed
            st.prefix = instruction_prefix(st.spec, st.env, self.protocol)
            st.actions_left = st.spec.max_actions_per_traj
            st.history = [TurnRecord(state=state, actions_left=st.actions_left)]
            st.num_actions = 0
            st.done = st.terminated = st.truncated = st.success = False
            st.end_reason = None
            if st.actions_left <= 0:  # a zero budget: nothing can ever be executed
                self._finish(st, "budget")
        self._reset_done = True
        return seeds

    def active_ids(self) -> list[int]:
        """Env ids whose episode is still running (the ones to generate for)."""
        return [s.env_id for s in self._states if not s.done]

    def is_done(self, env_id: int) -> bool:
        return self._states[env_id].done

    def messages(self, env_id: int, for_generation: bool = True, whole: bool = False) -> list[Message]:
        """The env's chat messages (generation prompt, or the training conversation); ``whole``: every
        turn, whatever the context window (the transcript of an episode trained turn by turn)."""
        st = self._states[env_id]
        protocol = self.protocol.model_copy(update={"max_context_window": -1}) if whole else self.protocol
        return build_messages(st.prefix, st.history, protocol, st.spec.max_tokens, for_generation)

    def step(self, responses: dict[int, str]) -> dict[int, StepOutcome]:
        """Play one turn in each env of ``responses`` (env_id -> forced prefix + generated text).

        Per env (docs/architecture.md, "Agent text protocol"): parse; charge the format penalty once
        if the turn is malformed; truncate the actions to the remaining budget; execute them in
        order and stop at the first ``done``. The turn reward is the sum of the executed actions'
        rewards, the info that of the last one (merged over the executed actions, so keys only some
        actions report survive). The episode ends when the env says done (success iff
        ``info["success"]``), when the budget is spent (truncated) or after ``max_turn`` turns
        (truncated).
        """
        if not self._reset_done:
            raise RuntimeError("EnvGroups.step() before reset()")
        bad = [i for i in responses if not (0 <= i < len(self._states)) or self._states[i].done]
        if bad:
            raise ValueError(f"step() got env ids that are not active: {sorted(bad)}")
        return {env_id: self._step_one(self._states[env_id], text) for env_id, text in responses.items()}

    def _step_one(self, st: _EnvState, text: str) -> StepOutcome:
        cfg = self.protocol
        parsed = parse_response(text, cfg, st.env.actions)
        penalty = 0.0 if parsed.format_ok else cfg.format_penalty
        to_run = parsed.actions[: st.actions_left]
        executed: list[str] = []
        reward = 0.0
        info: dict[str, Any] = {}
        env_done = False
        for action in to_run:
            result = st.env.step(action)
            executed.append(action)
            reward += float(result.reward)
            info.update(result.info)
            if result.done:
                env_done = True
                break
        st.actions_left -= len(executed)
        st.num_actions += len(executed)

        record = st.history[-1]
        record.response = parsed.normalized
        record.raw_response = text
        record.actions = executed
        record.reward = reward
        record.info = info
        record.format_ok = parsed.format_ok
        record.penalty = penalty
        turn = len(st.history)
        # The next state is the env's render (RAGEN): equal to the last observation for all
        # built-in envs, and still right when no action ran this turn.
        st.history.append(TurnRecord(state=st.env.render(), actions_left=st.actions_left))

        if env_done:
            st.terminated = True
            st.success = bool(info.get("success", False))
            self._finish(st, "done")
        elif st.actions_left <= 0:
            self._finish(st, "budget")
        elif turn >= cfg.max_turn:
            self._finish(st, "max_turn")
        return StepOutcome(
            env_id=st.env_id,
            turn=turn,
            parsed=parsed,
            actions=executed,
            reward=reward,
            penalty=penalty,
            info=info,
            done=st.done,
            success=st.success,
            actions_left=st.actions_left,
            end_reason=st.end_reason,
        )

    @staticmethod
    def _finish(st: _EnvState, reason: str) -> None:
        st.done = True
        st.end_reason = reason
        st.truncated = reason != "done"

    # ------------------------------------------------------------------ results
    def close(self) -> None:
        """Close every env (a remote one ends its server session)."""
        for st in self._states:
            st.env.close()

    def trajectories(self) -> list[EpisodeSummary]:
        """One summary per env (by env_id), for played turns only."""
        out = []
        for st in self._states:
            played = [r for r in st.history if r.played]
            reward = sum(r.reward for r in played)
            penalty = sum(r.penalty for r in played)
            out.append(
                EpisodeSummary(
                    env_id=st.env_id,
                    group_id=st.group_id,
                    tag=st.tag,
                    seed=st.seed,
                    turns=len(played),
                    success=st.success,
                    terminated=st.terminated,
                    truncated=st.truncated,
                    end_reason=st.end_reason,
                    reward=reward,
                    format_penalty=penalty,
                    score=reward + penalty,
                    num_actions=st.num_actions,
                    actions=[list(r.actions) for r in played],
                    turn_rewards=[r.reward for r in played],
                    turn_penalties=[r.penalty for r in played],
                    infos=[dict(r.info) for r in played],
                )
            )
        return out

    def metrics(self) -> dict[str, float]:
        """Rollout metrics (docs/metrics.md), unprefixed (the caller adds ``train/`` or ``val-env/``).

        Per env: ``success``, ``num_actions``, and for every numeric info key except ``success`` the
        sum over turns / number of turns (a turn that executed nothing contributes 0 but counts).
        Per tag: the mean over the tag's envs (``{tag}/...``), plus ``{tag}/pass@{N}`` (share of
        envs whose group has a success), ``num_turns``, ``reward``, ``format_penalty``, ``score``.
        ``success``: the mean over all envs.
        """
        summaries = self.trajectories()
        by_tag: dict[str, list[EpisodeSummary]] = {}
        for s in summaries:
            by_tag.setdefault(s.tag, []).append(s)
        group_success: dict[int, bool] = {}
        for s in summaries:
            group_success[s.group_id] = group_success.get(s.group_id, False) or s.success

        metrics: dict[str, float] = {}
        for tag, items in by_tag.items():
            per_env: list[dict[str, float]] = []
            keys: set[str] = set(_CORE_INFO_KEYS)
            for s in items:
                sums: dict[str, float] = {}
                for info in s.infos:
                    for k, v in info.items():
                        x = _as_number(v)
                        if k != "success" and x is not None:
                            sums[k] = sums.get(k, 0.0) + x
                denom = max(s.turns, 1)
                row = {k: v / denom for k, v in sums.items()}
                keys.update(row)
                row.update(
                    success=float(s.success),
                    num_actions=float(s.num_actions),
                    num_turns=float(s.turns),
                    reward=s.reward,
                    format_penalty=s.format_penalty,
                    score=s.score,
                )
                per_env.append(row)
            n = len(items)
            for k in (
                "success",
                "num_actions",
                *sorted(keys),
                "num_turns",
                "reward",
                "format_penalty",
                "score",
            ):
                metrics[f"{tag}/{k}"] = sum(row.get(k, 0.0) for row in per_env) / n
            metrics[f"{tag}/pass@{self.group_size}"] = (
                sum(float(group_success[s.group_id]) for s in items) / n
            )
        metrics["success"] = sum(float(s.success) for s in summaries) / max(len(summaries), 1)
        return metrics
