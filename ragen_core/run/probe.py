"""The learnability check: can RL learn anything from this config's policy before a run spends hours?

GRPO and PPO learn from the differences between a group's rewards. A policy whose every answer is
malformed, or whose group members always score the same, gives zero advantages: the run burns its
iterations and learns nothing. :func:`probe` plays a few groups of the config's train environments
with the config's own sampling and decoding and measures (docs/metrics.md, "Learnability probe"):

- ``probe/valid_answer_share``: the share of played turns whose answer parsed to valid actions;
- ``probe/action_mass``: the mean probability, over (at most 4 of) the first turns' prompts, that the policy
  (free decoding, temperature 1) writes a valid action right after the answer tag: the sum over the
  grammar's action spellings of the product of their tokens' probabilities (free-text environments: none);
- ``probe/varied_group_share``: the share of the played groups (at the config's ``train.group_size``)
  whose rewards are not all equal: an estimate of the share of an iteration's groups whose GRPO
  advantages are not zero. ``probe/varied_group_share_pooled`` beside it is ``1 - sum_v p_v^G`` with
  ``p_v`` the share of all episodes scoring ``v``: what the share would be if every group drew from one
  score distribution (an upper estimate when some maps are always won and others always lost).

Beside them, ``probe/chance_success`` and ``probe/chance_success_val``: the success of uniformly random
valid answers (:func:`chance_success`) on the same train episodes and on the validation episodes, with
the config's turns and action budget. A policy that succeeds no more often than that does not yet read
the state; the validation figure is the floor a trained policy's validation success is read against.

The verdict is *go* when the expected number of varied groups per iteration,
``varied_group_share * sum(train.n_groups)``, is at least :data:`MIN_VARIED_GROUPS`: then an
iteration is expected to hold a group whose advantages are not zero. The reason and the change to try
come with a *no-go*.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ragen_core.config import RagenConfig
from ragen_core.env_groups import EnvGroups
from ragen_core.protocol import join_actions, normalized_response

__all__ = [
    "CHANCE_EPISODES",
    "MIN_VARIED_GROUPS",
    "ProbeResult",
    "chance_success",
    "probe",
    "record_probe",
    "varied_group_share",
]

#: Go when an iteration is expected to hold at least this many groups with unequal rewards.
MIN_VARIED_GROUPS = 1.0
#: Episodes of random valid play behind each chance figure (:func:`chance_success`): a standard error of
#: at most 0.008.
CHANCE_EPISODES = 4096
#: Below this share of valid answers the advice is constrained decoding (or a warm start).
LOW_VALID_SHARE = 0.2


@dataclass
class ProbeResult:
    """The figures and the verdict of one probe."""

    metrics: dict[str, float]
    go: bool
    reason: str
    advice: list[str] = field(default_factory=list)
    episodes: int = 0
    seconds: float = 0.0

    def lines(self) -> list[str]:
        m = self.metrics
        out = [
            f"{'GO' if self.go else 'NO-GO'}: {self.reason}",
            f"  valid answers        {m['probe/valid_answer_share']:.3f} of {int(m['probe/turns'])} turns",
        ]
        if "probe/action_mass" in m:
            out.append(
                f"  action mass          {m['probe/action_mass']:.4f} after the answer tag (free decoding)"
            )
        out += [
            f"  varied groups        {m['probe/varied_group_share']:.3f} of {int(m['probe/groups'])} groups of "
            f"{int(m['probe/group_size'])} ({m['probe/varied_group_share_pooled']:.3f} if they shared one "
            "score distribution)",
            f"  expected per iter.   {m['probe/varied_groups_per_iteration']:.2f} varied groups of "
            f"{int(m['probe/n_groups'])} (go at >= {MIN_VARIED_GROUPS:g})",
            f"  success / score      {m['probe/success']:.3f} / {m['probe/score_mean']:.3f}",
        ]
        if "probe/chance_success" in m:
            out.append(
                f"  chance               {m['probe/chance_success']:.3f} success of random valid answers on "
                f"these episodes, {m['probe/chance_success_val']:.3f} on the validation episodes"
            )
        out += [f"  try: {a}" for a in self.advice]
        if self.go and m["probe/success"] == 0.0:
            out.append(
                "  caution: no episode succeeded; the rewards differ by the environment's step rewards alone "
                "(e.g. Sokoban's -0.1 a move), which RL can learn without learning the task"
            )
        if "probe/chance_success" in m and 0.0 < m["probe/success"] <= m["probe/chance_success"]:
            out.append(
                f"  caution: the policy succeeds no more often than random valid answers "
                f"({m['probe/success']:.3f} against {m['probe/chance_success']:.3f}): it does not yet read "
                "the state, and RL must teach it to before success can rise above chance"
            )
        return out


def chance_success(
    groups: EnvGroups, episodes: int = CHANCE_EPISODES, seed: int = 0, seed_round: int = 0
) -> float:
    """The success rate of uniformly random valid answers over at least ``episodes`` episodes.

    Every env of ``groups`` is played as often as that takes, each play reset for ``seed_round`` (so on
    the seeds a rollout of that round plays). Each turn's answer is the env's
    :meth:`~envs.base.Env.random_answer` (1 to min(3, ``agent.max_actions_per_turn``) actions, each
    uniform over the vocabulary; WebShop: one of the page's actions), played through the same turns,
    action budget and parser as a policy's answers. Draws only from ``random.Random(seed)``."""
    rng, cfg = random.Random(seed), groups.protocol
    wins = played = 0
    for _ in range(math.ceil(episodes / max(1, len(groups)))):
        groups.reset(seed_round)
        while active := groups.active_ids():
            answers = {}
            for env_id in active:
                actions = groups.env(env_id).random_answer([], cfg.max_actions_per_turn, rng)
                answers[env_id] = normalized_response("", join_actions(actions, cfg), cfg)
            groups.step(answers)
        summaries = groups.trajectories()
        wins += sum(ep.success for ep in summaries)
        played += len(summaries)
    return wins / max(1, played)


def varied_group_share(scores: Sequence[float], group_size: int) -> float:
    """``1 - sum_v p_v^G``: the chance that ``G`` episodes drawn from the scores' distribution do not
    all score the same (scores rounded to 1e-6, as the filter's zero-variance test)."""
    if not scores:
        return 0.0
    counts = Counter(round(float(s), 6) for s in scores)
    n = len(scores)
    return max(0.0, 1.0 - sum((c / n) ** group_size for c in counts.values()))


@torch.no_grad()
def action_mass(model: Any, prompts: Sequence[Sequence[int]], spellings: Sequence[Sequence[int]]) -> float:
    """Mean over ``prompts`` of ``sum_s prod_t pi(s_t | prompt, s_<t)`` over the action spellings ``s``
    (token ids): the probability that free decoding starts the answer with a valid action. One forward
    pass per prompt scores every one-token spelling; a longer spelling gets a pass of its own."""
    model.eval()
    total = 0.0
    for prompt in prompts:
        last = torch.log_softmax(model(input_ids=torch.tensor([list(prompt)])).logits[0, -1].float(), -1)
        mass = 0.0
        for spelling in spellings:
            if len(spelling) == 1:
                mass += math.exp(float(last[spelling[0]]))
                continue
            ids = torch.tensor([list(prompt) + list(spelling)])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            mass += math.exp(float(logp.gather(-1, torch.tensor(list(spelling))[:, None]).sum()))
        total += mass
    return total / max(1, len(prompts))


def _advice(valid: float, mass: float | None, varied: float, cfg: RagenConfig) -> list[str]:
    out = []
    free = cfg.agent.action_decoding == "free"
    if valid < LOW_VALID_SHARE and free:
        out.append(
            "--set agent.action_decoding=constrained (the answer can only spell valid actions)"
            + (
                f": the policy puts {mass:.4f} of its probability on a valid first action"
                if mass is not None
                else ""
            )
        )
    if valid < LOW_VALID_SHARE:
        out.append("a warm start on the environment's own demonstrations (an sft: section)")
    if valid >= LOW_VALID_SHARE and varied * cfg.train.num_groups < MIN_VARIED_GROUPS:
        out.append(
            f"more exploration: a higher rollout.temperature (now {cfg.rollout.temperature:g}) or top_k, "
            f"or a larger train.group_size (now {cfg.train.group_size})"
        )
    return out


def _chance_metrics(cfg: RagenConfig, probed: EnvGroups, seed: int) -> dict[str, float]:
    """Chance on the probe's own train episodes (seed round 10000) and on the validation seeds; none
    where a tag is played over the wire (thousands of episodes on someone's server)."""
    if cfg.train.remote or cfg.val.remote:
        return {}
    return {
        "probe/chance_success": chance_success(probed, seed=seed, seed_round=10_000),
        "probe/chance_success_val": chance_success(EnvGroups(cfg.val, cfg.agent, mode="val"), seed=seed),
    }


def probe(cfg: RagenConfig, groups: int = 4, seed: int = 0, chance: bool = True) -> ProbeResult:
    """Play ``groups`` groups of the config's train environments (at its group size, sampling and
    decoding) with its starting policy, and judge whether RL can learn from them; ``chance`` adds the
    success of random valid answers beside (:func:`chance_success`)."""
    import time

    from ragen_core.models.policies import policy_from_config
    from ragen_core.protocol import forced_prefix
    from ragen_core.rollout.constrained import ActionGrammar
    from ragen_core.rollout.engine import SamplingParams
    from ragen_core.rollout.hf_engine import HFEngine
    from ragen_core.rollout.runner import Segments, run_rollouts
    from ragen_core.run.stages import sampling_params

    t0 = time.perf_counter()
    model, tokenizer = policy_from_config(cfg.model)
    g = cfg.train
    per_tag = max(1, groups // len(g.tags))
    probe_groups = g.model_copy(update={"n_groups": [per_tag] * len(g.tags)})
    env_groups = EnvGroups(probe_groups, cfg.agent)
    engine = HFEngine(model, tokenizer, max_model_len=cfg.rollout.max_model_len)
    params = SamplingParams(**sampling_params(cfg, "train"))
    trajs = run_rollouts(env_groups, engine, tokenizer, params, seed=seed, seed_round=10_000, run_id="probe")

    penalties = [p for t in trajs for p in t.info["turn_penalties"]]
    valid = sum(1 for p in penalties if p == 0) / max(1, len(penalties))
    scores = [t.score for t in trajs]
    by_group: dict[int, list[float]] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t.score)
    varied = sum(1 for s in by_group.values() if max(s) - min(s) > 1e-6) / max(1, len(by_group))
    pooled = varied_group_share(scores, g.group_size)

    mass = None
    actions = env_groups.env(env_groups.env_ids[0]).actions
    if actions:
        seg = Segments(
            tokenizer, forced_prefix(cfg.agent) + ("</think><answer>" if cfg.agent.enable_think else "")
        )
        grammar = ActionGrammar.for_protocol(tokenizer, actions, cfg.agent)
        first = {tuple(seg.encode(seg.head(env_groups.messages(i, True)))) for i in env_groups.env_ids}
        mass = action_mass(model, sorted(first)[:4], grammar.spellings["action"])

    metrics = {
        "probe/valid_answer_share": valid,
        "probe/varied_group_share": varied,
        "probe/varied_group_share_pooled": pooled,
        "probe/varied_groups_per_iteration": varied * g.num_groups,
        "probe/success": sum(t.success for t in trajs) / max(1, len(trajs)),
        "probe/score_mean": sum(scores) / max(1, len(scores)),
        "probe/turns": float(len(penalties)),
        "probe/groups": float(len(by_group)),
        "probe/group_size": float(g.group_size),
        "probe/n_groups": float(g.num_groups),
    }
    if mass is not None:
        metrics["probe/action_mass"] = mass
    if chance:
        metrics.update(_chance_metrics(cfg, env_groups, seed))
    expected = varied * g.num_groups
    go = expected >= MIN_VARIED_GROUPS
    if go:
        reason = (
            f"about {expected:.1f} of the {g.num_groups} groups per iteration are expected to have unequal "
            "rewards, so the advantages are not all zero"
        )
    elif valid < LOW_VALID_SHARE:
        reason = (
            f"only {valid:.1%} of the answers are valid, so nearly every episode scores the format penalty "
            "alone and every group's rewards are equal: RL has nothing to reinforce"
        )
    else:
        reason = (
            f"the groups' rewards are nearly always equal ({expected:.2f} varied groups expected per "
            "iteration): the advantages are zero and RL has nothing to reinforce"
        )
    metrics["probe/go"] = float(go)
    seconds = time.perf_counter() - t0
    metrics["probe/seconds"] = seconds
    return ProbeResult(metrics, go, reason, _advice(valid, mass, varied, cfg), len(trajs), seconds)


def record_probe(cfg: RagenConfig, config_path: str | os.PathLike[str], result: ProbeResult) -> str:
    """Log the probe as an MLflow run of the config's experiment (params: the config; metrics at step 0;
    the printed report as ``probe.txt``); returns the run's page, or why it was not logged."""
    from ragen_core.config import flatten
    from ragen_core.state_folder import state_dir
    from ragen_core.tracking.tracker import Tracker

    tracker = Tracker(cfg.tracking, state_dir())
    name = f"probe-{Path(config_path).stem}"
    run_id = tracker.start(
        name,
        flatten(cfg),
        tags={"ragen.kind": "probe", "ragen.probe.verdict": "go" if result.go else "no-go"},
    )
    tracker.log_iteration(0, result.metrics)
    tracker.log_text("\n".join(result.lines()) + "\n", "probe.txt")
    tracker.end()
    if tracker.offline is not None:
        return f"not logged ({tracker.offline})"
    return tracker.run_url(run_id) or f"run {run_id} in {tracker.tracking_uri}"
