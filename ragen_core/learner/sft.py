"""Supervised warm start (SFT) on oracle demonstrations, in exactly the rollout token layout.

A tiny randomly initialised policy cannot produce ``<think>...</think><answer>A || B</answer>`` on its
own, so RL from scratch would only ever see format penalties. The warm start teaches the format (and
some of the task) by imitation, as RAGEN's appendix C compares SFT with RL:

1. **Demonstrations.** :func:`build_demonstrations` plays :class:`~ragen_core.env_groups.EnvGroups`
   episodes (mode ``"train"``, seeds from :attr:`SFTConfig.demo_seed`, far from the validation seeds
   ``123 + i`` and the RL train seeds ``10000 + iteration * P + i``). Each turn's answer is the
   oracle's next actions (:func:`envs.oracles.oracle_actions`) or, with probability
   ``1 - optimal_fraction``, the env's random answer (:meth:`envs.base.Env.random_answer`: random
   actions from its vocabulary, see :class:`SFTConfig`), written as the model would write it after the
   forced prefix: ``{think}</think><answer>A || B</answer>`` (no-think mode: ``A || B</answer>``),
   where ``think`` is the env's short deterministic sentence about the state
   (:meth:`envs.base.Env.think_text`). The answer goes through :meth:`EnvGroups.step` exactly as a sampled
   one would (forced prefix + decoded text), so the episode unfolds as a rollout would.
2. **Tokens.** The "sampled" ids of a turn are the tokenizer's encoding of that text plus the
   end-of-turn token; the conversation is assembled by the runner's own
   :meth:`~ragen_core.rollout.runner.Segments.assemble`, so a demonstration has the same
   ``input_ids``/``loss_mask`` a rollout trajectory with those sampled ids would have (tested against
   :func:`~ragen_core.rollout.runner.run_rollouts` with a replaying engine). The loss mask covers
   exactly the answer tokens and their end-of-turn token.
3. **Training.** :func:`train_sft`: masked next-token cross-entropy over the assistant tokens
   (token-mean over the batch), AdamW, linear warm-up then cosine decay, seeded shuffling;
   deterministic on CPU for a given seed and thread count. :func:`warm_start` builds the tiny policy
   (or loads ``ModelConfig.path``), trains it and saves it with :func:`~ragen_core.models.policies.save_policy`.

The demonstrations are written in the agent protocol the caller passes (the pipeline: the run's
``agent`` section), so the warm start and the rollouts that follow it read the same prompts.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from envs.base import Env
from envs.oracles import oracle_actions
from ragen_core.config.sft import SFTConfig
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.learner.critic import backbone
from ragen_core.learner.forward import decoder_hidden, shared_prefix_length
from ragen_core.progress import duration, progress_log
from ragen_core.protocol import ProtocolConfig, build_messages, forced_prefix
from ragen_core.rollout.runner import SampledTurn, Segments

__all__ = [
    "Demo",
    "build_demonstrations",
    "demo_groups_config",
    "pad_batch",
    "sft_loss",
    "train_sft",
    "warm_start",
]


@dataclass
class Demo:
    """One training sequence: a demonstrated episode (or, with a context window, one turn of it)."""

    tag: str
    env_id: int
    seed: int
    input_ids: list[int]
    loss_mask: list[int]
    turn_index: list[int]
    texts: list[str]  # generated text of each turn (after the forced prefix, without end-of-turn)
    actions: list[list[str]]  # answer items of each turn
    optimal: list[bool]  # whether each turn's actions came from the oracle
    success: bool
    turn_ids: list[list[int]] = field(default_factory=list)  # "sampled" ids per turn (eos included)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        return int(sum(self.loss_mask))


# --------------------------------------------------------------------------------------------
# Demonstrations
# --------------------------------------------------------------------------------------------
def _rng(*keys: int) -> random.Random:
    return random.Random(
        int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(1)[0])
    )


def demo_groups_config(cfg: SFTConfig) -> EnvGroupsConfig:
    """The env groups the demonstrations are played in (mode ``"train"``, reset at iteration 0)."""
    return EnvGroupsConfig(
        tags=list(cfg.tags),
        n_groups=[cfg.episodes_per_tag] * len(cfg.tags),
        group_size=1,
        seed=cfg.demo_seed,
        env_overrides=dict(cfg.env_overrides),
    )


def _answer_text(env: Env, actions: list[str], protocol: ProtocolConfig) -> str:
    answer = f" {protocol.action_sep} ".join(a.strip() for a in actions)
    if protocol.enable_think:
        return f"{env.think_text(actions)}</think><answer>{answer}</answer>"
    return f"{answer}</answer>"


def build_demonstrations(
    tokenizer: Any, cfg: SFTConfig, protocol: ProtocolConfig | None = None
) -> list[Demo]:
    """Play the demonstration episodes and return their token sequences (deterministic given ``cfg``).

    Sequence layout: with the full history (``max_context_window = -1``) one sequence per episode,
    as :func:`~ragen_core.rollout.runner.run_rollouts` builds it; with a window of ``k`` turns, one
    sequence per turn (the exact prompt the policy sees at that turn plus its answer), trained on that
    turn only, so that every turn is learned once. ``protocol``: the agent protocol the demonstrations
    are written in, the run's ``agent`` section (default: RAGEN's defaults).
    """
    protocol = protocol or ProtocolConfig()
    prefix = forced_prefix(protocol)
    seg = Segments(tokenizer, prefix)
    groups = EnvGroups(demo_groups_config(cfg), protocol, mode="train")
    seeds = groups.reset(0)
    turns: dict[int, list[SampledTurn]] = {i: [] for i in groups.env_ids}
    texts: dict[int, list[str]] = {i: [] for i in groups.env_ids}
    acts: dict[int, list[list[str]]] = {i: [] for i in groups.env_ids}
    optimal: dict[int, list[bool]] = {i: [] for i in groups.env_ids}
    episode_optimal = {i: _rng(cfg.seed, seeds[i]).random() < cfg.optimal_fraction for i in groups.env_ids}

    for turn in range(protocol.max_turn):
        active = groups.active_ids()
        if not active:
            break
        responses: dict[int, str] = {}
        for i in active:
            env = groups.env(i)
            history = groups.history(i)
            actions_left = history[-1].actions_left
            turns_left = protocol.max_turn - (len(history) - 1)
            cap = max(1, min(protocol.max_actions_per_turn, actions_left))
            plan = list(oracle_actions(env, actions_left, protocol.max_actions_per_turn, turns_left))
            rng = _rng(cfg.seed, seeds[i], turn + 1)
            use_oracle = (
                episode_optimal[i] if cfg.noise_unit == "episode" else rng.random() < cfg.optimal_fraction
            )
            if use_oracle and plan:
                chosen, is_opt = plan, True
            else:
                chosen, is_opt = env.random_answer(plan, cap, rng), False
            text = _answer_text(env, chosen, protocol)
            ids = [*seg.encode(text), seg.eos_id]
            turns[i].append(SampledTurn(ids=ids, logprobs=[0.0] * len(ids), closed=True))
            texts[i].append(text)
            acts[i].append([a.strip() for a in chosen])
            optimal[i].append(is_opt)
            # Exactly what the runner hands to the env groups for sampled ids.
            responses[i] = prefix + tokenizer.decode(ids, skip_special_tokens=True)
        groups.step(responses)

    demos: list[Demo] = []
    for ep in groups.trajectories():
        i = ep.env_id
        common = dict(
            tag=ep.tag,
            env_id=i,
            seed=ep.seed,
            texts=texts[i],
            actions=acts[i],
            optimal=optimal[i],
            success=ep.success,
            turn_ids=[t.ids for t in turns[i]],
        )
        demos += [
            Demo(input_ids=ids, loss_mask=mask, turn_index=tidx, **common)  # type: ignore[arg-type]
            for ids, mask, tidx in _sequences(groups, seg, protocol, i, turns[i])
        ]
    return demos


def _sequences(
    groups: EnvGroups, seg: Segments, protocol: ProtocolConfig, env_id: int, turns: list[SampledTurn]
) -> list[tuple[list[int], list[int], list[int]]]:
    """Tokens, loss mask and turn index of one demonstration episode: one sequence with the full
    history, else one per turn (its prompt inside the window plus its answer, trained on that turn)."""
    window = protocol.max_context_window
    if window <= 0:
        ids, mask, tidx, _, _ = seg.assemble(groups.messages(env_id, for_generation=False), turns, 0)
        return [(ids, mask, tidx)]
    history = groups.history(env_id)
    out = []
    for j in range(len(turns)):
        start = max(0, j + 1 - window)
        messages = build_messages(
            groups.prefix(env_id), history[: j + 1], protocol, groups.max_tokens(env_id), False
        )
        ids, mask, tidx, _, _ = seg.assemble(messages, turns[start : j + 1], start)
        out.append((ids, [m if t == j else 0 for m, t in zip(mask, tidx, strict=True)], tidx))
    return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
def pad_batch(demos: Sequence[Demo], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (positions start at 0 per row)."""
    n = max(d.num_tokens for d in demos)
    ids = torch.full((len(demos), n), pad_id, dtype=torch.long)
    attn = torch.zeros((len(demos), n), dtype=torch.long)
    mask = torch.zeros((len(demos), n), dtype=torch.bool)
    for r, d in enumerate(demos):
        k = d.num_tokens
        ids[r, :k] = torch.tensor(d.input_ids)
        attn[r, :k] = 1
        mask[r, :k] = torch.tensor(d.loss_mask, dtype=torch.bool)
    return ids, attn, mask


def _epoch_batches(demos: Sequence[Demo], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch of batches (popped from the end): a seeded shuffle, then length bucketing inside
    windows of 8 batches (less padding), then a seeded shuffle of the batches."""
    idx = list(range(len(demos)))
    rng.shuffle(idx)
    batch_size = min(batch_size, len(demos))
    batches: list[list[int]] = []
    window = 8 * batch_size
    for w in range(0, len(idx), window):
        chunk = sorted(idx[w : w + window], key=lambda k: demos[k].num_tokens)
        batches.extend(chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def sft_loss(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    shared_prefix: bool = False,
) -> tuple[torch.Tensor, int]:
    """Token-mean cross-entropy of the tokens where ``loss_mask`` is 1, each predicted from its prefix.

    Only the hidden states that predict a trained token go through the LM head (the vocabulary
    projection of the prompt positions is never computed). With ``shared_prefix`` the leading tokens
    every row shares run once (:func:`~ragen_core.learner.forward.decoder_hidden`: same loss and
    gradients up to float rounding). Returns ``(loss, n_tokens)``.
    """
    targets = loss_mask[:, 1:]
    base = backbone(model)  # the transformer body, also through a LoRA wrapper (as the learner reads it)
    p = shared_prefix_length(input_ids, loss_mask, attention_mask) if shared_prefix else 0
    hidden = decoder_hidden(base, input_ids, p, attention_mask)
    logits = model.lm_head(hidden[:, :-1][targets[:, p:]]).float()
    y = input_ids[:, 1:][targets]
    return torch.nn.functional.cross_entropy(logits, y), int(y.numel())


def _lr_factor(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# The warm start of a tiny config trains for 13-32 minutes: ten lines show it moving and its loss falling.
SFT_PROGRESS_LINES = 10


def sft_progress_line(step: int, steps: int, curve: Sequence[Sequence[float]], seconds: float) -> str:
    """``warm start: step 300/3000 | loss 0.362 | 1m45s | ETA 15m45s`` (the loss: the curve's last point)."""
    loss = f" | loss {curve[-1][1]:.3f}" if curve else ""
    eta = seconds / step * (steps - step)
    return f"warm start: step {step}/{steps}{loss} | {duration(seconds)} | ETA {duration(eta)}"


def train_sft(
    model: Any,
    tokenizer: Any,
    cfg: SFTConfig,
    protocol: ProtocolConfig | None = None,
    demos: list[Demo] | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place on the demonstrations (built from ``cfg`` unless given).

    Returns metrics: ``loss_curve`` (mean loss per ``log_every`` steps, as ``[step, loss]``),
    ``final_loss`` (mean of the last ``log_every`` steps), ``steps``, ``trained_tokens``,
    ``seconds`` (training), ``demo_seconds``, ``num_demos``, ``demo_tokens``, demo success and
    optimal-turn rates, and ``stopped_early`` (the ``max_seconds`` guard fired).
    """
    t0 = time.perf_counter()
    if demos is None:
        demos = build_demonstrations(tokenizer, cfg, protocol)
    if not demos:
        raise ValueError("no demonstrations to train on")
    demo_seconds = time.perf_counter() - t0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    old_threads = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    t1 = time.perf_counter()
    model.train()
    try:
        step, curve, tokens, stopped_early = _train_steps(model, demos, cfg, pad_id, t0, t1)
    finally:
        model.eval()
        if cfg.num_threads is not None:
            torch.set_num_threads(old_threads)
    turns = [o for d in demos for o in d.optimal]
    return {
        "steps": step,
        "loss_curve": curve,
        "final_loss": curve[-1][1] if curve else float("nan"),
        "trained_tokens": tokens,
        "seconds": time.perf_counter() - t1,
        "demo_seconds": demo_seconds,
        "num_demos": len(demos),
        "demo_tokens": sum(d.num_tokens for d in demos),
        "demo_trained_tokens": sum(d.num_trained for d in demos),
        "demo_success": sum(d.success for d in demos) / len(demos),
        "demo_optimal_turns": sum(turns) / max(1, len(turns)),
        "stopped_early": stopped_early,
    }


def _train_steps(
    model: Any, demos: list[Demo], cfg: SFTConfig, pad_id: int, t0: float, t1: float
) -> tuple[int, list[list[float]], int, bool]:
    """The optimizer steps (AdamW, no weight decay on biases and norms); returns the steps taken, the
    loss curve, the trained tokens and whether the ``max_seconds`` guard (from ``t0``) fired. ``t1``:
    when training started, for the progress lines."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=cfg.betas,
    )
    order_rng = random.Random(cfg.seed)
    order: list[list[int]] = []
    curve: list[list[float]] = []
    window: list[float] = []
    tokens = 0
    step = 0
    for step in range(cfg.steps):
        if cfg.max_seconds is not None and time.perf_counter() - t0 > cfg.max_seconds:
            if window:
                curve.append([step, sum(window) / len(window)])
            return step, curve, tokens, True
        if not order:
            order = _epoch_batches(demos, cfg.batch_size, order_rng)
        batch = [demos[k] for k in order.pop()]
        ids, attn, mask = pad_batch(batch, pad_id)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * _lr_factor(step, cfg)
        loss, n = sft_loss(model, ids, attn, mask, shared_prefix=cfg.shared_prefix)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        tokens += n
        window.append(float(loss.detach()))
        if len(window) == cfg.log_every:
            curve.append([step + 1, sum(window) / len(window)])
            window = []
        if (step + 1) * SFT_PROGRESS_LINES // cfg.steps > step * SFT_PROGRESS_LINES // cfg.steps:
            progress_log.info(sft_progress_line(step + 1, cfg.steps, curve, time.perf_counter() - t1))
    step = cfg.steps
    if window:
        curve.append([step, sum(window) / len(window)])
    return step, curve, tokens, False


def warm_start(
    model_cfg: Any, sft_cfg: SFTConfig, out_dir: str | Path, protocol: ProtocolConfig | None = None
) -> Path:
    """Build the policy of ``model_cfg`` (tiny or ``path``), train it on demonstrations, save it.

    Writes the policy (HF format, :func:`~ragen_core.models.policies.save_policy`) and ``sft_metrics.json`` in
    ``out_dir`` and returns ``out_dir``. ``sft_metrics.json`` adds ``build_seconds`` (tokenizer and
    model) and ``total_seconds`` to :func:`train_sft`'s metrics.
    """
    from ragen_core.models.policies import policy_from_config, save_policy

    t0 = time.perf_counter()
    model, tokenizer = policy_from_config(model_cfg)
    build_seconds = time.perf_counter() - t0
    metrics = train_sft(model, tokenizer, sft_cfg, protocol)
    path = save_policy(model, tokenizer, out_dir)
    metrics.update(build_seconds=build_seconds, total_seconds=time.perf_counter() - t0)
    (path / "sft_metrics.json").write_text(json.dumps(metrics, indent=2))
    return path
