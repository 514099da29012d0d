"""A learner step's metrics under their logged names (RAGEN / veRL's; docs/metrics.md).

``UpdateMetrics`` sums what the optimiser updates report over micro-batches and reduces it across the
data-parallel ranks once; ``step_metrics`` turns those sums and the step's tensors into the logged
numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ragen_core.algorithms import kl_penalty, masked_mean
from ragen_core.config.learner import AlgorithmConfig
from ragen_core.learner.batch import TokenBatch
from ragen_core.learner.forward import StepTensors

__all__ = ["UpdateMetrics", "step_metrics"]


class UpdateMetrics:
    """The metrics of a step's optimiser updates, summed over micro-batches, reduced across ranks once.

    Two kinds of metric, kept apart because the step averages them differently (``step_metrics``):

    - ``per_update``: one value per optimiser update (a loss: each micro-batch adds its share of its
      mini-batch's loss; a gradient norm), reported as the mean over the step's updates;
    - ``per_token``: a mean over a micro-batch's trained tokens (entropy, clip fractions, approx KL,
      predicted values), added times those tokens and reported as the mean over all trained tokens.

    ``counts`` holds, per role (``actor/``, ``critic/``), the denominators ``updates`` and ``tokens``,
    and ``skipped_steps``, reported as a count. Keys are the logged metric names.
    """

    def __init__(self) -> None:
        self.per_update: dict[str, float] = {}
        self.per_token: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    @staticmethod
    def _add(sums: dict[str, float], key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    def declare(self, per_update: list[str], per_token: list[str], counts: list[str]) -> None:
        """Add 0 to every key an update reports: the same keys on every rank (an all-reduce needs
        equal lengths), even on a rank without rows in this mini-batch."""
        for sums, keys in ((self.per_update, per_update), (self.per_token, per_token), (self.counts, counts)):
            for key in keys:
                self._add(sums, key, 0.0)

    def declare_role(self, prefix: str, kl_loss: bool) -> None:
        """:meth:`declare` every key an update of ``prefix`` (actor / critic) reports (``kl_loss``:
        the actor's loss has a KL term)."""
        if prefix == "critic":
            per_update = ["critic/vf_loss"]
            per_token = ["critic/vf_clipfrac", "critic/vpred_mean"]
        else:
            per_update = ["actor/pg_loss"] + (["actor/kl_loss"] if kl_loss else [])
            per_token = ["actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"]
        self.declare(
            per_update=[*per_update, f"{prefix}/grad_norm"],
            per_token=per_token,
            counts=[f"{prefix}/tokens", f"{prefix}/skipped_steps", f"{prefix}/updates"],
        )

    def add(self, key: str, value: float | torch.Tensor) -> None:
        """A per-update value: a micro-batch's share of the update's loss, or the update's grad norm."""
        self._add(self.per_update, key, float(value))

    def add_token_mean(self, key: str, mean: float | torch.Tensor, n_tokens: float) -> None:
        """A mean over ``n_tokens`` trained tokens, weighted by them."""
        self._add(self.per_token, key, float(mean * n_tokens))

    def count(self, key: str, n: float | torch.Tensor) -> None:
        self._add(self.counts, key, float(n))

    def reduce(self, world_size: int, device: torch.device) -> None:
        """Sum every metric over the data-parallel group, in place, with one all-reduce."""
        if world_size == 1:
            return
        slots = [
            (sums, key) for sums in (self.per_update, self.per_token, self.counts) for key in sorted(sums)
        ]
        if not slots:
            return
        buf = torch.tensor([sums[key] for sums, key in slots], dtype=torch.float64, device=device)
        dist.all_reduce(buf)
        for (sums, key), total in zip(slots, buf.tolist(), strict=True):
            sums[key] = total

    def means(self) -> dict[str, float]:
        """The sums as logged: per-update values over the updates, per-token values over the tokens,
        skipped steps as a count; nothing of a role that made no update."""
        out: dict[str, float] = {}
        for prefix in ("actor", "critic"):
            updates = self.counts.get(f"{prefix}/updates", 0.0)
            tokens = self.counts.get(f"{prefix}/tokens", 0.0)
            if updates == 0:
                continue
            mine = prefix + "/"
            out.update({k: v / updates for k, v in self.per_update.items() if k.startswith(mine)})
            out.update({k: v / max(tokens, 1.0) for k, v in self.per_token.items() if k.startswith(mine)})
            out[f"{prefix}/skipped_steps"] = round(self.counts.get(f"{prefix}/skipped_steps", 0.0))
        return out


def _batch_stats(
    out: dict[str, float], data: StepTensors, scores: torch.Tensor, token_rewards: torch.Tensor
) -> None:
    """Mean, max and min of the scores, rewards, advantages, returns and values; the critic's
    explained variance."""
    mask = data.mask

    def stats(name: str, x: torch.Tensor) -> None:
        sel = x[mask] if x.dim() == 2 else x
        out[f"{name}/mean"] = float(sel.mean())
        out[f"{name}/max"] = float(sel.max())
        out[f"{name}/min"] = float(sel.min())

    stats("critic/score", scores)
    stats("critic/rewards", token_rewards.sum(dim=1))
    stats("critic/advantages", data.advantages)
    stats("critic/returns", data.returns)
    if data.values is not None:
        values, returns = data.values, data.returns
        stats("critic/values", values)
        var_ret = torch.var(returns[mask])
        out["critic/vf_explained_var"] = float(1.0 - torch.var((returns - values)[mask]) / (var_ret + 1e-5))


def step_metrics(
    sums: UpdateMetrics,
    data: StepTensors,
    scores: torch.Tensor,
    token_rewards: torch.Tensor,
    batch: TokenBatch,
    alg: AlgorithmConfig,
    lrs: dict[str, float],
) -> dict[str, float]:
    """The step's metrics under their logged names: the updates' sums (``sums``, reduced across
    ranks) as means over updates or over trained tokens, the learning rates ``lrs`` (``actor/lr``,
    ``critic/lr``), then statistics of the batch."""
    out = sums.means()
    out["actor/entropy_loss"] = out.get("actor/entropy", 0.0)  # RAGEN's name for the same number
    out.update(lrs)
    if alg.use_kl_loss:
        out["actor/kl_coef"] = alg.kl_loss_coef
    mask = data.mask
    maskf = mask.to(data.old_logp.dtype)
    _batch_stats(out, data, scores, token_rewards)
    out["rollout/old_log_prob"] = float(masked_mean(data.old_logp, maskf))
    if data.ref_logp is not None:
        out["rollout/ref_log_prob"] = float(masked_mean(data.ref_logp, maskf))
    if alg.use_kl_in_reward:
        assert data.ref_logp is not None  # use_kl_in_reward implies use_ref
        kl = kl_penalty(data.old_logp, data.ref_logp, alg.kl_in_reward_type)
        out["actor/reward_kl_penalty"] = float(masked_mean(kl, maskf))
        out["actor/reward_kl_penalty_coeff"] = alg.kl_coef
    rollout_logp = getattr(batch, "rollout_logprobs", None)
    if rollout_logp is not None:
        rl = rollout_logp[:, : maskf.shape[1]].to(maskf.device, maskf.dtype)
        if bool((rl[mask] != 0).any()):
            gap = (data.old_logp - rl).abs()
            out["rollout/old_vs_rollout_logprob_diff"] = float(masked_mean(gap, maskf))
            out["rollout/old_vs_rollout_logprob_max_diff"] = float(gap[mask].max())
    per_seq = maskf.sum(dim=1)
    out["response_length/mean"] = float(per_seq.mean())
    out["response_length/max"] = float(per_seq.max())
    out["response_length/min"] = float(per_seq.min())
    return out
