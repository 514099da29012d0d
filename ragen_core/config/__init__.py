"""One pydantic config tree for a ragen-flow run, loaded from YAML with dotted overrides.

Each section is owned by the module that uses it (the protocol, env groups, model, learner); this
module composes them, adds the rollout and trainer sections, and checks the combinations that only
make sense together (a group size of 1 with the std filter, a mini-batch larger than the filtered
batch, ...) so that a bad config fails before any work starts, naming the key and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ragen_core.algorithm_modes import SPREAD_FILTER_METRICS, kept_group_count
from ragen_core.config.learner import LearnerConfig
from ragen_core.config.model import ModelConfig
from ragen_core.config.numbers import MAX_ITERATIONS, non_finite_problems
from ragen_core.config.sft import SFTConfig
from ragen_core.config.tracking import TrackingConfig, flatten_params
from ragen_core.env_groups import EnvGroupsConfig
from ragen_core.errors import RagenError
from ragen_core.monitor import MonitorConfig
from ragen_core.protocol import ProtocolConfig
from ragen_core.safe_yaml import AliasBombError, safe_load

#: The config ``ragen train`` trains when none is given (the README's main job).
DEFAULT_CONFIG = "configs/bandit-tiny.yaml"


class ConfigError(RagenError, ValueError):
    """A config that cannot run: the message names the key and the fix."""


#: Keys that earlier versions had and that this one removed, with what to set instead. A run's stored
#: config.yaml still holds them (every field was written out), so ``load_config(..., stored=True)``
#: drops them; a config someone writes with one is refused with this fix.
REMOVED_KEYS: dict[tuple[str, ...], str] = {
    # The pipeline always wrote the demonstrations in the run's agent protocol; this copy was unused.
    ("sft", "protocol"): "removed: the warm start writes its demonstrations in the run's agent protocol; "
    "set agent.* instead (e.g. agent.enable_think)",
    ("rollout", "filter_ratio"): "renamed: write rollout.filter.value (the fraction of the groups kept by "
    "the default rollout.filter.strategy top_k), e.g. rollout.filter.value=0.5",
    ("rollout", "filter_type"): "renamed: write rollout.filter.keep (std is largest, std_rev is smallest), "
    "e.g. rollout.filter.keep=smallest",
}

#: The :data:`REMOVED_KEYS` that live on under another name: old path -> (new path, old value -> new
#: value where the values were respelled too). ``load_config(..., stored=True)`` moves them, so a run
#: directory written before the rename (its config.yaml holds every field of its day) loads to the same
#: config, with the same hash. The old filter keys meant ``strategy: top_k, metric: reward_variance,
#: include_zero: true``: the defaults, so only the value and the kept end move.
RENAMED_KEYS: dict[tuple[str, ...], tuple[tuple[str, ...], dict[Any, Any]]] = {
    ("rollout", "filter_ratio"): (("rollout", "filter", "value"), {}),
    ("rollout", "filter_type"): (("rollout", "filter", "keep"), {"std": "largest", "std_rev": "smallest"}),
}


def tag_problems(tags: Iterable[str], key: str) -> list[str]:
    """One message per tag of ``tags`` (the value of config key or option ``key``) that no catalogue
    entry, plug-in or run-time registration provides, with the closest known tags."""
    import envs

    known = envs.tags()
    problems = []
    for tag in tags:
        if tag in known:
            continue
        close = difflib.get_close_matches(tag, known, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        problems.append(
            f"{key}: unknown environment tag {tag!r}; {hint}known tags: {', '.join(known)} "
            "(envs/catalogue.yaml)"
        )
    return problems


def _model_shape_problems(m: ModelConfig) -> list[str]:
    """What transformers' Qwen2 attention needs of the tiny model's shape (a saved model brings its own)."""
    if m.path is not None:
        return []
    problems = []
    if m.hidden_size % m.num_heads:
        problems.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads} "
            "(each head gets hidden_size / num_heads dimensions); change either, e.g. "
            f"model.hidden_size={max(m.num_heads, m.hidden_size // m.num_heads * m.num_heads)}"
        )
    elif (m.hidden_size // m.num_heads) % 2:
        problems.append(
            f"model.hidden_size / model.num_heads = {m.hidden_size // m.num_heads} is odd; rotary "
            "position embeddings rotate pairs of dimensions, so the head size must be even: change "
            "model.hidden_size or model.num_heads"
        )
    if m.num_heads % m.num_kv_heads:
        problems.append(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads} "
            "(grouped-query attention shares each key/value head among num_heads / num_kv_heads "
            "query heads); choose a model.num_kv_heads that divides model.num_heads"
        )
    return problems


def played_actions(cfg: RagenConfig) -> list[tuple[str, str, list[str] | None]]:
    """``(key, tag, actions)`` for every train and validation tag: the action names its env (with the
    config's overrides) offers, None for free-text answers; a tag whose env cannot be built is left out
    (it is reported where it is played), and so is one whose actions follow its state (WebShop's
    clickables: no fixed list to check; constrained decoding spells each turn's)."""
    import envs

    out = []
    for key, groups in (("train.tags", cfg.train), ("val.tags", cfg.val)):
        for tag in groups.tags:
            try:
                env = envs.make(tag, **groups.env_overrides.get(tag, {}))
            except Exception:
                continue
            if not env.state_actions:
                out.append((key, tag, env.actions))
    return out


def _action_decoding_problems(cfg: RagenConfig) -> list[str]:
    """Constrained decoding needs environments with a list of actions (both rollout engines implement it;
    what only the vllm engine limits, the number of distinct grammar tokens, preflight checks)."""
    if cfg.agent.action_decoding != "constrained":
        return []
    problems = []
    for key, tag, actions in played_actions(cfg):
        if actions is None:
            problems.append(
                f"{key}: {tag} has free-text answers (no list of actions), so agent.action_decoding="
                "constrained has nothing to spell; set agent.action_decoding=free or train on an "
                "environment with actions (Bandit, FrozenLake, Sokoban, WebShop)"
            )
    return problems


class RolloutFilterConfig(BaseModel):
    """The rollout filter (RAGEN-2's ``rollout_filter_*``; docs/architecture.md, "Algorithms contract"):
    a group metric, a strategy over it and the strategy's value. The default is StarPO-S as it always
    was here: the 25% of groups with the largest in-group score std."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["top_p", "top_k", "top_k_abs", "min_p"] = Field(
        default="top_k",
        description="top_k: a fraction of the groups; top_k_abs: a number of groups; top_p: the best groups "
        "holding a share of the metric's total; min_p: the groups within a factor of the best",
    )
    value: float = Field(
        default=0.25,
        gt=0.0,
        description="the strategy's value: top_k the fraction of groups kept, in (0, 1]; top_k_abs the number "
        "of groups kept (an integer >= 1); top_p the share p in (0, 1] (1 keeps all); min_p the factor p in (0, 1]",
    )
    metric: Literal["reward_variance", "reward", "reward_sum", "entropy", "entropy_variance", "length"] = (
        Field(default="reward_variance", description="the group value ranked (see docs/architecture.md)")
    )
    keep: Literal["largest", "smallest"] = Field(
        default="largest", description="keep the largest or smallest values"
    )
    include_zero: bool = Field(
        default=True, description="groups whose metric is 0 are candidates (False: never kept)"
    )
    top_p_mode: Literal["linear", "softmax"] = Field(
        default="linear", description="top_p: share of the metric's sum (linear) or of its softmax"
    )
    selection_eps: float = Field(default=0.01, ge=0.0, description="top_p linear: threshold p x sum - eps")
    loss_scaling: Literal["none", "linear", "sqrt"] = Field(
        default="none",
        description="multiply the advantages by the kept fraction of groups r (linear) or sqrt(r) (sqrt)",
    )

    @model_validator(mode="after")
    def _value_fits_strategy(self) -> RolloutFilterConfig:
        if self.strategy == "top_k_abs":
            if self.value < 1 or not float(self.value).is_integer():
                raise ValueError(
                    f"rollout.filter.value={self.value} with rollout.filter.strategy=top_k_abs must be a "
                    "whole number of groups >= 1 (e.g. 4); for a fraction of the groups use strategy top_k"
                )
        elif self.value > 1.0:
            raise ValueError(
                f"rollout.filter.value={self.value} with rollout.filter.strategy={self.strategy} must be in "
                "(0, 1]; for a number of groups use strategy top_k_abs"
            )
        return self

    def keeps_everything(self) -> bool:
        """True when the filter keeps every group whatever the rollouts (no filtering: vanilla StarPO)."""
        return self.include_zero and self.strategy in ("top_k", "top_p") and self.value >= 1.0

    def fixed_group_count(self, n_groups: int) -> int | None:
        """The number of groups kept out of ``n_groups`` when the strategy fixes it, else None
        (top_p and min_p adapt to the rollouts; ``include_zero=False`` may keep fewer)."""
        if self.strategy == "top_k":
            return kept_group_count(self.value, n_groups)
        if self.strategy == "top_k_abs":
            return min(int(self.value), n_groups)
        return None


class RolloutConfig(BaseModel):
    """Generation settings (RAGEN's defaults) and the StarPO-S filter (docs/architecture.md, "Agent text
    protocol" and "Algorithms contract")."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["hf", "vllm"] = Field(default="hf", description="rollout backend")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None,
        description="weights of the rollout engine (None: model.dtype); e.g. bfloat16 rollouts beside a float32 "
        "learner, as verl runs vLLM; rollout/old_vs_rollout_logprob_diff logs the gap this opens",
    )
    temperature: float = Field(default=1.0, ge=0.0, description="training rollouts")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 disables")
    max_new_tokens: int = Field(default=400, ge=1, description="per turn (RAGEN's response_length)")
    val_temperature: float = Field(default=0.5, ge=0.0, description="validation rollouts")
    filter: RolloutFilterConfig = Field(
        default_factory=RolloutFilterConfig,
        description="StarPO-S rollout filter (default: the 25% of groups with the largest score variance)",
    )
    max_batch_size: int | None = Field(default=None, ge=1, description="engine micro-batch (memory only)")
    max_model_len: int | None = Field(default=None, ge=16, description="prompt + generation limit")
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0, description="vLLM")
    enforce_eager: bool = Field(default=True, description="vLLM: no CUDA graphs")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM")


class TrainerConfig(BaseModel):
    """The iteration loop and where its state goes."""

    model_config = ConfigDict(extra="forbid")

    run_name: str | None = Field(default=None, description="default: <config name>-<hash>")
    iterations: int = Field(
        default=200,
        ge=0,
        le=MAX_ITERATIONS,
        description=f"rollout-update iterations (at most {MAX_ITERATIONS}: folders are named iter_0001...)",
    )
    eval_every: int = Field(default=10, ge=0, description="validate every k iterations (0: only at the ends)")
    val_before_train: bool = Field(default=True)
    seed: int = Field(default=0, description="the run's seed: sampling, shuffles, inits")
    run_root: str | None = Field(
        default=None, description="run directories live here (default: <state folder>/runs)"
    )
    backend: Literal["ray", "local"] = Field(
        default="ray", description="ray: rollout and learner actors; local: everything in this process"
    )
    learners: int = Field(default=1, ge=1, description="data-parallel learner actors")
    actor_loss_retries: int = Field(
        default=2,
        ge=0,
        description="ray backend: times a run rebuilds its actors after one is lost (a node died, a worker "
        "crashed) and retries from its last completed iteration, with as many learners as the cluster "
        "then holds",
    )
    off_policy_steps: int = Field(
        default=0,
        ge=0,
        le=1,
        description="0: each iteration's rollouts are played by the policy it updates; 1: one-step "
        "off-policy (verl's one_step_off_policy, AReaL): iteration k+1's rollouts are played by the policy "
        "before iteration k's update, while the learner makes it (on the ray backend, at the same time), "
        "and the PPO ratio is taken against the rollouts' own log-probs",
    )
    rollout_cpus: float = Field(default=1, gt=0, description="CPUs of the rollout actor")
    rollout_gpus: float = Field(default=0, ge=0, description="GPUs of the rollout actor")
    rollout_threads: int | None = Field(default=None, ge=1, description="torch threads in the rollout worker")
    keep_optimizer_states: int | None = Field(
        default=None,
        ge=2,
        description="None: every iteration's checkpoint keeps its optimiser state; N: only the last N do "
        "(AdamW's state is twice the weights: 1 GB an iteration for a 135M model), older ones keep their "
        "weights (evaluate, logged models) but cannot be resumed or rerun from",
    )
    keep_policies: int | None = Field(
        default=None,
        ge=2,
        description="None: every iteration's checkpoint keeps its weights; N: only the last N iterations "
        "and the validated ones (every trainer.eval_every, where the best policy is chosen) do, the others "
        "keep their rollouts, metrics and a WEIGHTS_PRUNED note (0.5 GB an iteration saved for a 135M "
        "model in float32): they cannot be evaluated, rerun or continued from",
    )
    probe: Literal["warn", "error", "off"] = Field(
        default="warn",
        description="before a new run without a warm start, the learnability check of `ragen probe` on the "
        "starting policy (a few groups of the train envs): warn logs a no-go and trains on; error stops the "
        "run before its folder exists; off skips it (a config with sft: always skips it: the warm start "
        "changes the policy it would judge)",
    )

    @field_validator("probe", mode="before")
    @classmethod
    def _probe_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    iteration_as: Literal["subflow", "task"] = Field(
        default="task",
        description="task: each iteration is a parent task run nesting the stage tasks, in the training "
        "flow run's task list (client-side, no API round trips); subflow: a Prefect flow run of its own "
        "(its own page in the UI; ~7 API calls, a few hundred ms per iteration). One default for every "
        "config, so that every env's runs look alike in Prefect",
    )


class RagenConfig(BaseModel):
    """A whole run. Defaults are RAGEN's base.yaml (StarPO-S, Sokoban, Qwen2.5-0.5B aside)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    agent: ProtocolConfig = Field(default_factory=ProtocolConfig)
    train: EnvGroupsConfig = Field(
        default_factory=lambda: EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[8], group_size=16)
    )
    val: EnvGroupsConfig = Field(
        default_factory=lambda: EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[256], group_size=1)
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig | None = Field(default=None, description="supervised warm start before RL (None: off)")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    @model_validator(mode="after")
    def _finite(self) -> RagenConfig:
        problems = non_finite_problems(self.model_dump())
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    @model_validator(mode="after")
    def _combinations(self) -> RagenConfig:
        # Tags and shapes are checked here, not where they are used: a typo there surfaces after the
        # warm start has run and left a run directory behind.
        problems = [*tag_problems(self.train.tags, "train.tags"), *tag_problems(self.val.tags, "val.tags")]
        if self.sft is not None:
            problems += tag_problems(self.sft.tags, "sft.tags")
        problems += _model_shape_problems(self.model)
        problems += _action_decoding_problems(self)
        for key, what in (("keep_optimizer_states", "optimiser states"), ("keep_policies", "weights")):
            keep = getattr(self.trainer, key)
            if keep is not None and self.monitor.action == "rollback":
                problems.append(
                    f"trainer.{key}={keep} prunes the {what} a monitor.action=rollback may need; use "
                    f"monitor.action=stop (or none), or trainer.{key}=null"
                )
        if problems:
            raise ValueError("\n  ".join(problems))
        g, f, algo = self.train, self.rollout.filter, self.learner.algorithm
        if g.group_size == 1 and f.metric in SPREAD_FILTER_METRICS and not f.keeps_everything():
            what = f.metric.removesuffix("_variance")
            raise ValueError(
                f"train.group_size=1 has no in-group {what} variance for the StarPO-S filter "
                f"(rollout.filter.metric={f.metric}); set rollout.filter.value=1 (with strategy top_k or "
                "top_p: no filtering), another rollout.filter.metric, or train.group_size>=2"
            )
        if g.group_size == 1 and algo.group_baseline:
            raise ValueError(
                f"learner.algorithm.adv_estimator={algo.adv_estimator} needs train.group_size>=2 "
                "(its baseline is the group)"
            )
        kept_groups = f.fixed_group_count(g.num_groups)
        kept = g.num_groups * g.group_size if kept_groups is None else kept_groups * g.group_size
        mb = self.learner.optim.mini_batch_size
        if kept_groups is None and not f.keeps_everything() and mb > g.group_size:
            # top_p / min_p keep as many groups as their values allow, as few as one: a larger
            # mini-batch would stop the run at the first iteration that keeps less (after the warm start)
            raise ValueError(
                f"learner.optim.mini_batch_size={mb} is larger than one group ({g.group_size} trajectories), "
                f"the least that rollout.filter.strategy={f.strategy} may keep in an iteration; lower "
                f"learner.optim.mini_batch_size (and micro_batch_size) to <= {g.group_size}, or use strategy "
                "top_k / top_k_abs, which keep a fixed number of groups"
            )
        if mb > kept:
            shown = "all" if kept_groups is None else str(kept_groups)
            raise ValueError(
                f"learner.optim.mini_batch_size={mb} is larger than the filtered batch ({kept} = "
                f"{shown} kept groups x {g.group_size}); lower learner.optim.mini_batch_size to "
                f"<= {kept} or raise rollout.filter.value / train.n_groups"
            )
        norm = algo.reward_normalization
        largest = {"state": g.group_size, "inductive": max(g.n_groups) * g.group_size, "batch": kept}
        if norm.active and largest[norm.grouping] < 2:
            raise ValueError(
                f"learner.algorithm.reward_normalization.method={norm.method!r} with grouping "
                f"{norm.grouping!r} only sees groups of one trajectory here (train.group_size={g.group_size}), "
                "which it leaves as they are; set train.group_size>=2, another grouping, or method identity"
            )
        return self


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    keys = dotted.split(".")
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` -> nested dict; values are YAML (numbers, lists, null, ...)."""
    tree: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not KEY=VALUE (e.g. --set learner.algorithm.clip_high=0.28)"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"--set {item}: the value is not valid YAML ({problem}); close its brackets and "
                f"quotes, or quote it as a string: --set '{key.strip()}=\"...\"'"
            ) from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    model: Any = RagenConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _paths_named(name: str, model: Any = RagenConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config whose last part is ``name`` (``seed``: ``trainer.seed``, ...)."""
    found = []
    for field_name, field in getattr(model, "model_fields", {}).items():
        path = f"{prefix}{field_name}"
        if field_name == name:
            found.append(path)
        for sub in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                found.extend(_paths_named(name, sub, path + "."))
    return found


def _unknown_key_hint(loc: tuple[Any, ...]) -> str:
    """The keys of that very name in other sections (``seed``: ``trainer.seed``, ...), else the nearest
    known key at the same level (``trainer.sed``: ``trainer.seed``)."""
    elsewhere = sorted(set(_paths_named(str(loc[-1]))))
    if elsewhere:
        return f"; it is a key of another section: {' or '.join(elsewhere)}"
    close = difflib.get_close_matches(str(loc[-1]), _fields_at(loc), n=1)
    return f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""


def _explain(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not isinstance(p, int))
        key = ".".join(str(p) for p in loc) or "(config)"
        removed = REMOVED_KEYS.get(tuple(map(str, loc)))
        if err["type"] == "extra_forbidden" and removed is not None:
            lines.append(f"{key}: {removed}")
        elif err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_unknown_key_hint(loc)}")
        elif not loc:  # a cross-field check: its message names the keys
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {msg} (got {err.get('input')!r})"[:400])
    return ConfigError(f"invalid config {source}:\n  " + "\n  ".join(lines))


def _drop_removed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the :data:`REMOVED_KEYS` an earlier version wrote (a copy; ``data`` is kept)."""
    out = dict(data)
    for path in REMOVED_KEYS:
        node: Any = out
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                break
            node[key] = dict(node[key])  # copy the path down, so the caller's dicts are not changed
            node = node[key]
        else:
            node.pop(path[-1], None)
    return out


def _move_renamed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the :data:`RENAMED_KEYS` an earlier version wrote moved to their new paths, their
    values respelled (a copy; ``data`` is kept). A new key already set keeps its value."""
    out = dict(data)
    for old_path, (new_path, values) in RENAMED_KEYS.items():
        parent = out
        for key in old_path[:-1]:
            if not isinstance(parent.get(key), dict):
                break
            parent[key] = dict(parent[key])  # copy the path down, so the caller's dicts are not changed
            parent = parent[key]
        else:
            if old_path[-1] not in parent:
                continue
            value = parent.pop(old_path[-1])
            if value is None:
                continue
            node = out
            for key in new_path[:-1]:
                node[key] = dict(node.get(key) or {})
                node = node[key]
            node.setdefault(new_path[-1], values.get(value, value))
    return out


def load_config(
    path: str | Path | None = None, overrides: Iterable[str] = (), *, stored: bool = False
) -> RagenConfig:
    """Load a YAML config (or the defaults) and apply ``KEY=VALUE`` overrides.

    ``stored``: ``path`` is a run's own config.yaml, maybe written by an earlier version; keys that
    version wrote and this one renamed (:data:`RENAMED_KEYS`) are moved to their new names, and those
    it removed (:data:`REMOVED_KEYS`) are dropped, in the file (not in ``overrides``), so old runs
    still load, resume and rerun.
    """
    data: dict[str, Any] = {}
    source = "(defaults)"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            data = safe_load(p.read_text()) or {}
        except AliasBombError as exc:
            raise ConfigError(f"config file {p}: {exc}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                f"config file {p}: YAML syntax error{where}: {problem}; fix the file there "
                "(indentation, a missing ':' or an unclosed bracket or quote)"
            ) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {p} is not UTF-8 text ({exc.reason}); pass a YAML config"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        source = str(p)
        if stored:
            data = _drop_removed(_move_renamed(data))
    data = _merge(data, parse_overrides(overrides))
    try:
        return RagenConfig.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, source) from None


def config_hash(cfg: RagenConfig) -> str:
    """A short stable digest of everything that changes results (names cache keys and runs)."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def flatten(cfg: RagenConfig | Mapping[str, Any]) -> dict[str, str]:
    """Dotted keys -> string values, as logged to MLflow (``tracking.flatten_params``: strings as they
    are, everything else as JSON), so a resume compares exactly what the run's params show."""
    return flatten_params(cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg)


def dump_config(cfg: RagenConfig, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return p
