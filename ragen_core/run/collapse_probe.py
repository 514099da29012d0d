"""The model-facing part of the collapse metrics: which (prompt, response) pairs of a rollout are
scored, and the ``collapse/*`` metrics from the policy's cross log-probs of them.

See docs/metrics.md, "Collapse metrics". The pairs are first turns (RAGEN-2's ``first_turn``
sample): the prompt is everything before the first sampled token, the response the tokens sampled in
that turn. The sample is deterministic (no RNG is drawn, so the run's trajectories and weights are
those of a run without it): the first ``monitor.collapse_prompts`` groups of the rollout in group
order, and of each the first ``monitor.collapse_responses_per_prompt`` members. Every response is
scored under every distinct prompt of the sample, so the cost is (responses x distinct prompts)
forward passes of the policy, without gradients.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import torch

from ragen_core.algorithms.collapse import collapse_stats
from ragen_core.monitor import MonitorConfig

#: ``(prompts, responses) -> (len(responses), len(prompts))`` summed log-probs of each response after
#: each prompt (``Learner.cross_logprobs``).
CrossScorer = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], torch.Tensor]


@dataclass(frozen=True)
class CollapseSample:
    """The sampled pairs: ``prompts`` the distinct prompt token lists, ``classes[j]`` the distinct
    prompt of sampled group (column) j, ``responses`` the response token lists and ``cols[i]`` the
    column of response i's own group."""

    prompts: list[list[int]]
    classes: list[int]
    responses: list[list[int]]
    cols: list[int]


def first_turn_pair(
    input_ids: Sequence[int], loss_mask: Sequence[int], turn_index: Sequence[int]
) -> tuple[list[int], list[int]] | None:
    """(prompt, response) of a trajectory's first trained turn; None when it sampled no token."""
    first = next((t for t, m in enumerate(loss_mask) if m), None)
    if first is None:
        return None
    turn = turn_index[first]
    response = [
        int(input_ids[t]) for t in range(first, len(input_ids)) if loss_mask[t] and turn_index[t] == turn
    ]
    return [int(x) for x in input_ids[:first]], response


def sample_pairs(table: pa.Table, max_prompts: int, responses_per_prompt: int) -> CollapseSample:
    """The deterministic sample of a rollout table (see the module docstring). A trajectory whose
    first turn was cut by a context window, or whose prompt differs from its group's first sampled
    member's, is left out: a column must be one prompt."""
    cols_ = table.select(["group_id", "input_ids", "loss_mask", "turn_index", "info"]).to_pydict()
    by_group: dict[int, list[tuple[list[int], list[int]]]] = {}
    for gid, ids, mask, turns, info in zip(
        cols_["group_id"],
        cols_["input_ids"],
        cols_["loss_mask"],
        cols_["turn_index"],
        cols_["info"],
        strict=True,
    ):
        meta = json.loads(info) if info else {}
        if int(meta.get("first_trained_turn", 0) or 0) != 0:
            continue
        pair = first_turn_pair(ids, mask, turns)
        if pair is None:
            continue
        if int(gid) not in by_group and len(by_group) >= max_prompts:
            continue
        members = by_group.setdefault(int(gid), [])
        if len(members) < responses_per_prompt and (not members or members[0][0] == pair[0]):
            members.append(pair)
    prompts: list[list[int]] = []
    classes: list[int] = []
    responses: list[list[int]] = []
    col_of: list[int] = []
    for j, gid in enumerate(sorted(by_group)):
        prompt = by_group[gid][0][0]
        if prompt not in prompts:
            prompts.append(prompt)
        classes.append(prompts.index(prompt))
        for _, response in by_group[gid]:
            responses.append(response)
            col_of.append(j)
    return CollapseSample(prompts, classes, responses, col_of)


def collapse_due(cfg: MonitorConfig, k: int) -> bool:
    """At iteration 1 and every ``collapse_every`` iterations (RAGEN-2's ``compute_freq``); never at 0."""
    every = cfg.collapse_every
    return every > 0 and k >= 1 and (k == 1 or k % every == 0)


def collapse_metrics(table: pa.Table, score: CrossScorer, cfg: MonitorConfig) -> dict[str, float]:
    """``collapse/*`` metrics of a rollout under the policy ``score`` runs, and ``timing_s/collapse``.

    Fewer than two sampled groups: only the timing (there is no mixture of prompts)."""
    t0 = time.perf_counter()
    sample = sample_pairs(table, cfg.collapse_prompts, cfg.collapse_responses_per_prompt)
    out: dict[str, float] = {}
    if len(sample.classes) >= 2:
        per_prompt = score(sample.prompts, sample.responses).double()  # (N, distinct prompts)
        classes = torch.tensor(sample.classes, dtype=torch.int64)
        cross = per_prompt[:, classes]  # (N, P): one column per sampled group
        n_tokens = torch.tensor([len(r) for r in sample.responses], dtype=torch.float64)
        stats = collapse_stats(cross, n_tokens, torch.tensor(sample.cols, dtype=torch.int64), classes)
        out = {f"collapse/{k}": v for k, v in stats.items()}
        out["collapse/num_responses"] = float(len(sample.responses))
        out["collapse/num_prompts"] = float(len(sample.classes))
        out["collapse/num_distinct_prompts"] = float(len(sample.prompts))
    out["timing_s/collapse"] = time.perf_counter() - t0
    return out
