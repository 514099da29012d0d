"""The stages of an iteration as plain functions over a run directory (the Prefect tasks of
``tasks/stages.py`` wrap them): warm start, rollout, filter, learn, evaluate, finish.

A stage reuses its stored output only when its record says the output is intact and was made from
the same inputs (``ragen_core.run.stage_record``); otherwise it runs again."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from ragen_core import filter_record
from ragen_core.algorithms import (
    TOKEN_FILTER_METRICS,
    ZERO_TOL,
    GroupSelection,
    filter_loss_scale,
    filter_rollouts,
    group_std_stats,
)
from ragen_core.config import RagenConfig, RolloutFilterConfig
from ragen_core.errors import RagenError
from ragen_core.faults import crash_point
from ragen_core.integrity import record_tree, verify_tree
from ragen_core.learner.batch import to_token_batch
from ragen_core.progress import progress_log as _log
from ragen_core.run import stage_record
from ragen_core.run.collapse_probe import collapse_due, collapse_metrics
from ragen_core.run.run_dir import RunDir, atomic_write_text, copy_tokenizer
from ragen_core.run.session import Session
from ragen_core.storage import as_os_error, write_error
from ragen_core.trajectory import read_table, write_table

#: ``run.json``'s record of the folder whose warm starts the run may share (a sweep's, relative to the
#: state folder when inside it), and of the warm start it reused from there.
SHARED_WARM_STARTS_KEY, REUSED_WARM_START_KEY = "shared_warm_starts", "reused_warm_start"


def warm_start_key(cfg: RagenConfig) -> str:
    """What a warm start is a function of, digested: the model, the SFT section (its demonstrations,
    steps and seed), the protocol (prompts and answer format) and torch's thread count (CPU kernels sum
    in an order that depends on it). Two configs with the same key train bitwise the same warm start."""
    import hashlib
    import json

    import torch

    parts = {
        "model": cfg.model.model_dump(mode="json"),
        "sft": cfg.sft.model_dump(mode="json") if cfg.sft is not None else None,
        "agent": cfg.agent.model_dump(mode="json"),
        "torch_threads": torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _copy_tree(src: Path, dst: Path) -> None:
    """``src`` to ``dst``, files hard-linked where the disk allows (a stored policy is never modified
    in place), else copied."""
    import shutil

    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


def _shared_warm_start(cfg: RagenConfig, run: RunDir) -> Path | None:
    """Where a warm start of ``cfg`` is kept for the runs that share ``run``'s folder of warm starts
    (a sweep's members: the same config and seed need one warm start, not one each); None when the
    run shares none or has no warm start."""
    from ragen_core.state_folder import indexed_run

    folder = run.info().get(SHARED_WARM_STARTS_KEY)
    if cfg.sft is None or not folder:
        return None
    return indexed_run(str(folder)) / warm_start_key(cfg)


def init_policy_stage(cfg: RagenConfig, run: RunDir) -> Path:
    """The starting policy in ``<run>/init_policy``: the configured model, warm-started by SFT if set.

    Written to a temporary folder and renamed, so a killed warm start leaves nothing half-made. A run
    that shares warm starts (a sweep member) takes a stored one of the same key, checked against its
    digests, instead of training it again, and stores the one it trains.
    """
    import shutil

    from ragen_core.learner.sft import warm_start
    from ragen_core.models.policies import policy_from_config, save_policy

    if (run.init_policy / "config.json").exists():
        check_init_policy(run)
        return run.init_policy
    tmp = run.root / f".init_policy.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shared = _shared_warm_start(cfg, run)
    try:
        if shared is not None and (shared / "config.json").is_file():
            verify_tree(shared, fix=f"Delete {shared}: the next run that needs it trains it again")
            _copy_tree(shared, tmp)
            run.update_info(**{REUSED_WARM_START_KEY: shared.name})
            _log.info("warm start: reused %s (the same model, SFT and protocol)", shared)
        else:
            if cfg.sft is not None:
                warm_start(cfg.model, cfg.sft, tmp, protocol=cfg.agent)
            else:
                model, tokenizer = policy_from_config(cfg.model)
                save_policy(model, tokenizer, tmp)
            record_tree(tmp)  # inside the folder, before the rename: the digests travel with it
            if shared is not None:
                _store_shared(tmp, shared)
        os.replace(tmp, run.init_policy)
    except Exception as exc:
        os_error = as_os_error(exc, run.init_policy)  # before the cleanup frees the disk again
        shutil.rmtree(tmp, ignore_errors=True)
        if os_error is None:
            raise
        raise write_error(run.init_policy, os_error, "the starting policy") from exc
    return run.init_policy


def _store_shared(policy: Path, shared: Path) -> None:
    """Keep a copy of a trained warm start for the runs that share it (built beside, then renamed: a
    run that stores the same key at the same time keeps its own, and neither is half-made)."""
    import shutil

    staging = shared.with_name(f".{shared.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shared.parent.mkdir(parents=True, exist_ok=True)
    _copy_tree(policy, staging)
    try:
        os.replace(staging, shared)
    except OSError:  # another member stored it first: theirs is the same warm start
        shutil.rmtree(staging, ignore_errors=True)


def check_init_policy(run: RunDir) -> None:
    """Verify ``<run>/init_policy`` against its ``SHA256SUMS`` before a learner or a rollout worker
    loads it (runs from before digests have none and pass)."""
    verify_tree(
        run.init_policy,
        fix="Restore the folder from a copy, or start a new run: every iteration of "
        "this run was trained from it",
    )


def check_resumable(run: RunDir) -> int:
    """What a resume starts from, checked before anything is started or written: every complete
    iteration's metrics (re-logged to MLflow) and the state after the last one. Returns that
    iteration; a damaged file raises naming it."""
    from ragen_core.learner.checkpoint import verify_checkpoint

    last = run.last_complete()
    for k in range(1, last + 1):
        run.read_json(run.metrics_file(k))
    start = run.start_of(last + 1)
    if start > 0:
        verify_checkpoint(run.checkpoint(start))
    elif run.init_policy.exists():
        check_init_policy(run)
    return last


def sampling_params(cfg: RagenConfig, split: str) -> dict[str, Any]:
    r = cfg.rollout
    temperature = r.temperature if split == "train" else r.val_temperature
    return {
        "temperature": temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "max_new_tokens": r.max_new_tokens,
    }


def play(
    cfg: RagenConfig, run: RunDir, session: Session, split: str, k: int
) -> tuple[pa.Table, dict[str, float]]:
    """One episode per env of ``split`` with the session's current policy: iteration ``k``'s train
    seeds (round ``k - 1``), or the fixed validation seeds of the policy after ``k`` iterations. The
    rows carry ``k``, as the folders and MLflow steps do. Shared by the stages and their reruns."""
    played: tuple[pa.Table, dict[str, float]] = session.call_worker(
        "rollout",
        split,
        k - 1 if split == "train" else 0,
        k,
        sampling_params(cfg, split),
        cfg.trainer.seed,
        run.info().get("run_id", ""),
    )
    return played


def _response_metrics(table: pa.Table, prefix: str) -> dict[str, float]:
    masks = table.column("loss_mask").to_pylist()
    lengths = [sum(m) for m in masks]
    infos = [json.loads(s) for s in table.column("info").to_pylist()]
    n = max(len(lengths), 1)
    return {
        f"{prefix}response_length/mean": sum(lengths) / n,
        f"{prefix}response_length/max": float(max(lengths, default=0)),
        f"{prefix}response_length/clip_ratio": sum(1 for i in infos if i.get("response_truncated")) / n,
        f"{prefix}score/mean": sum(table.column("score").to_pylist()) / n,
    }


def behaviour_policy(cfg: RagenConfig, run: RunDir, k: int) -> int:
    """The iteration whose policy plays iteration ``k``'s rollouts.

    On-policy (``trainer.off_policy_steps: 0``): the state iteration ``k`` starts from
    (:meth:`RunDir.start_of`). One-step off-policy (``1``): the state iteration ``k - 1`` started from,
    because iteration ``k``'s rollouts are played while iteration ``k - 1`` updates; except for the
    first iteration, and after a rollback, which restarts the pipeline from the rollback's target."""
    on_policy = run.start_of(k)
    if cfg.trainer.off_policy_steps == 0 or k == 1 or run.rolled_back_to(k - 1) is not None:
        return on_policy
    return run.start_of(k - 1)


def rollout_ahead(cfg: RagenConfig, k: int) -> int | None:
    """The iteration whose rollouts are played while iteration ``k`` updates: ``k + 1`` with
    ``trainer.off_policy_steps: 1`` (up to the configured last iteration), else none."""
    if cfg.trainer.off_policy_steps == 0 or k >= cfg.trainer.iterations:
        return None
    return k + 1


def rollout_stage(cfg: RagenConfig, run: RunDir, k: int, session: Session) -> tuple[Path, dict[str, float]]:
    """Iteration ``k``'s train rollouts, played by :func:`behaviour_policy` (on-policy: the state
    iteration ``k`` starts from, after ``k - 1`` iterations or where a rollback went back to).

    Reuses this run's stored rollouts when they are intact and were played by the same policy
    (``ragen_core.run.stage_record``), so a resumed iteration does not play again. Moves only the rollout
    worker, so that it may play while the learner updates (one-step off-policy)."""
    behaviour = behaviour_policy(cfg, run, k)
    record, inputs = run.stage_record("rollout", k), {"policy": run.policy_after(behaviour)}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        return run.rollouts(k), stored["metrics"]
    session.worker_to(behaviour)
    t0 = time.perf_counter()
    table, env_metrics = play(cfg, run, session, "train", k)
    crash_point("rollout", k)
    path = write_table(table, run.rollouts(k))
    seconds = time.perf_counter() - t0
    tokens = sum(sum(m) for m in table.column("loss_mask").to_pylist())
    metrics = {f"train/{key}": v for key, v in env_metrics.items()}
    metrics.update(_response_metrics(table, ""))
    metrics.update({"timing_s/gen": seconds, "perf/rollout_tokens_per_s": tokens / max(seconds, 1e-9)})
    stage_record.save(record, inputs, [path], metrics)
    return path, metrics


class EmptyFilterError(RagenError, ValueError):
    """The rollout filter kept no group: there is nothing to train on."""


def select_rollouts(f: RolloutFilterConfig, table: pa.Table) -> GroupSelection:
    """The groups of a trajectory table that the rollout filter ``f`` keeps (``filter_rollouts`` on
    the table's scores, and for the entropy and length metrics its sampled tokens' log-probs and loss
    mask)."""
    scores = torch.tensor(table.column("score").to_pylist(), dtype=torch.float64)
    groups = torch.tensor(table.column("group_id").to_pylist(), dtype=torch.int64)
    logprobs = mask = None
    if f.metric in TOKEN_FILTER_METRICS:
        batch = to_token_batch(table)
        logprobs, mask = batch.rollout_logprobs.to(torch.float64), batch.loss_mask
    return filter_rollouts(
        scores,
        groups,
        f.strategy,
        f.value,
        metric=f.metric,
        keep=f.keep,
        include_zero=f.include_zero,
        top_p_mode=f.top_p_mode,
        selection_eps=f.selection_eps,
        logprobs=logprobs,
        mask=mask,
    )


def _empty_filter_message(f: RolloutFilterConfig, selection: GroupSelection, k: int) -> str:
    values = selection.group_values
    zero = int((values.abs() <= ZERO_TOL).sum())
    strategy = f"top_p ({f.top_p_mode})" if f.strategy == "top_p" else f.strategy
    return (
        f"iteration {k}: the rollout filter kept none of the {values.shape[0]} groups (strategy {strategy}, "
        f"value {f.value}, metric {f.metric}, keep {f.keep}, include_zero {str(f.include_zero).lower()}; "
        f"{zero} groups have metric 0, the largest is {float(values.nan_to_num(0.0).max()):.4g}), so there "
        "is nothing to train on. Start a new run with a filter that always keeps a group: "
        "rollout.filter.include_zero=true with strategy top_k or top_k_abs, or a larger rollout.filter.value "
        "(top_p 1 keeps every group); a resumed run keeps its config"
    )


def filter_stage(cfg: RagenConfig, run: RunDir, k: int) -> tuple[list[int], dict[str, float]]:
    """StarPO-S: keep whole groups chosen by ``rollout.filter`` (by default the ``value`` fraction of
    them with the largest in-group score std); writes the kept rows, the statistics and each group's
    statistics and decision to the iteration's ``filter.json`` (``ragen_core.filter_record``). A filter that keeps no group raises :class:`EmptyFilterError`."""
    rollouts, out = run.rollouts(k), run.filter_file(k)
    record, inputs = run.stage_record("filter", k), {"rollouts": rollouts}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        return stored["extra"]["kept_rows"], stored["metrics"]
    table = read_table(rollouts)
    scores = torch.tensor(table.column("score").to_pylist(), dtype=torch.float64)
    groups = torch.tensor(table.column("group_id").to_pylist(), dtype=torch.int64)
    f = cfg.rollout.filter
    selection = select_rollouts(f, table)
    n_groups = int(selection.kept_groups.shape[0])
    n_kept = int(selection.kept_groups.sum())
    if n_groups and not n_kept:
        raise EmptyFilterError(_empty_filter_message(f, selection, k))
    keep = selection.keep
    kept = torch.nonzero(keep).flatten().tolist()
    before, after = group_std_stats(scores, groups), group_std_stats(scores[keep], groups[keep])
    metrics = {f"rollout/{k}": float(v) for k, v in before.items()}
    metrics.update({f"rollout/chosen_{k}": float(v) for k, v in after.items()})
    metrics["rollout/kept_trajectories"] = float(len(kept))
    values = selection.group_values.nan_to_num(0.0)
    metrics["rollout/filter_kept_count"] = float(n_kept)
    metrics["rollout/filter_kept_ratio"] = n_kept / n_groups if n_groups else 1.0
    metrics["rollout/filter_zero_count"] = float((values.abs() <= ZERO_TOL).sum())
    metrics["rollout/filter_metric_mean"] = float(values.mean()) if n_groups else 0.0
    metrics["rollout/chosen_filter_metric_mean"] = (
        float(values[selection.kept_groups].mean()) if n_kept else 0.0
    )
    decisions = filter_record.group_decisions(table, kept, selection.group_values.tolist())
    atomic_write_text(out, json.dumps(filter_record.to_json(kept, metrics, decisions), indent=1))
    stage_record.save(record, inputs, [out], metrics, {"kept_rows": kept})
    return kept, metrics


def update_policy(cfg: RagenConfig, session: Session, table: pa.Table, kept: list[int]) -> dict[str, float]:
    """The learner step of an iteration: on the ``kept`` rows of its rollouts ``table``, with
    ``rollout.filter.loss_scaling`` (RAGEN-2's filter_loss_scaling) from the kept fraction of the groups.
    The learn stage and a rerun of it both take this step, so a rerun repeats it exactly."""
    all_groups = len(set(table.column("group_id").to_pylist()))
    table = table.take(pa.array(kept, type=pa.int64()))
    scale = filter_loss_scale(
        len(set(table.column("group_id").to_pylist())), all_groups, cfg.rollout.filter.loss_scaling
    )
    return session.learner.step(
        to_token_batch(table), advantage_scale=scale, behaviour_logprobs=cfg.trainer.off_policy_steps > 0
    )


def learn_stage(cfg: RagenConfig, run: RunDir, k: int, session: Session, kept: list[int]) -> dict[str, float]:
    """One learner step on the kept trajectories; saves the checkpoint of iteration ``k``."""
    rollouts = run.rollouts(k)
    record = run.stage_record("learn", k)
    start = run.start_of(k)
    inputs = {"state": run.checkpoint(start), "rollouts": rollouts, "filter": run.filter_file(k)}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        stored_metrics: dict[str, float] = stored["metrics"]
        return stored_metrics
    session.learner_to(start)
    table = read_table(rollouts)
    # Before the update and over all groups, kept or not (as RAGEN-2): the policy that played them.
    probe = (
        collapse_metrics(table, session.learner.cross_logprobs, cfg.monitor)
        if collapse_due(cfg.monitor, k)
        else {}
    )
    t0 = time.perf_counter()
    metrics = update_policy(cfg, session, table, kept)
    metrics.update(probe)
    metrics["timing_s/update"] = time.perf_counter() - t0
    # learner updates between the policy that played the rollouts and the one they update
    metrics["rollout/staleness"] = float(start - behaviour_policy(cfg, run, k))
    crash_point("learn", k)
    t0 = time.perf_counter()
    session.learner.save_checkpoint(str(run.checkpoint(k)), k)
    copy_tokenizer(run.init_policy, run.checkpoint(k) / "policy")
    metrics["timing_s/checkpoint"] = time.perf_counter() - t0
    # one-step off-policy: the rollout worker may be playing iteration k + 1 with older weights now
    session.advance(k, sync_worker=cfg.trainer.off_policy_steps == 0)
    # the learner count changes float summation order: a rerun of this stage takes it from here
    stage_record.save(record, inputs, [run.checkpoint(k)], metrics, {"learners": session.learners})
    return metrics


def evaluate_stage(
    cfg: RagenConfig, run: RunDir, step: int, session: Session
) -> tuple[Path, dict[str, float]]:
    """Validation rollouts (fixed seeds, validation temperature) of the policy after ``step`` iterations."""
    record, inputs = run.stage_record("evaluate", step), {"policy": run.policy_after(step)}
    stored = stage_record.load(record, inputs)
    if stored is not None:
        return run.eval_file(step), stored["metrics"]
    session.restore(step)
    t0 = time.perf_counter()
    table, env_metrics = play(cfg, run, session, "val", step)
    path = write_table(table, run.eval_file(step))
    metrics = {f"val-env/{key}": v for key, v in env_metrics.items()}
    metrics.update(held_out_apart(cfg, env_metrics))
    metrics.update(_response_metrics(table, "val/"))
    metrics["timing_s/testing"] = time.perf_counter() - t0
    atomic_write_text(run.eval_metrics_file(step), json.dumps(metrics, indent=1, sort_keys=True))
    stage_record.save(record, inputs, [path, run.eval_metrics_file(step)], metrics)
    return path, metrics


def held_out_apart(cfg: RagenConfig, env_metrics: Mapping[str, float]) -> dict[str, float]:
    """Validation success never averages a trained tag with a held-out one (a tag the run does not
    train on, such as BanditTest): with held-out tags, ``val-env/success`` is the success over the
    trained tags' episodes and ``val-env/held-out/success`` over the others'. Without, nothing changes."""
    val, trained = cfg.val, set(cfg.train.tags)
    episodes: dict[str, int] = {}
    for tag, n in zip(val.tags, val.n_groups, strict=True):
        episodes[tag] = episodes.get(tag, 0) + n * val.group_size
    held_out = [t for t in episodes if t not in trained]
    if not held_out:
        return {}
    out: dict[str, float] = {}
    for key, tags in (
        ("val-env/success", [t for t in episodes if t in trained]),
        ("val-env/held-out/success", held_out),
    ):
        n = sum(episodes[t] for t in tags)
        if n:
            out[key] = sum(env_metrics[f"{t}/success"] * episodes[t] for t in tags) / n
    return out


def eval_due(cfg: RagenConfig, step: int) -> bool:
    t = cfg.trainer
    if step == 0:
        return t.val_before_train
    return step == t.iterations or (t.eval_every > 0 and step % t.eval_every == 0)


def prune_optimizer_states(cfg: RagenConfig, run: RunDir, k: int) -> list[int]:
    """``trainer.keep_optimizer_states = N``: once iteration ``k`` is done, the checkpoints of iterations
    ``<= k - N`` lose their optimiser state (their weights stay). The next iteration's learn stage reads
    only iteration ``k``'s; returns the iterations pruned now."""
    from ragen_core.learner.checkpoint_pruning import prune_optimizer_state

    keep = cfg.trainer.keep_optimizer_states
    if keep is None:
        return []
    reason = f"pruned after iteration {k} (trainer.keep_optimizer_states={keep})"
    return [j for j in range(1, k - keep + 1) if prune_optimizer_state(run.checkpoint(j), reason)]


def prune_policies(cfg: RagenConfig, run: RunDir, k: int) -> list[int]:
    """``trainer.keep_policies = N``: once iteration ``k`` is done, the checkpoints of iterations
    ``<= k - N`` that were not validated lose their weights (``checkpoint_pruning.prune_weights``). What the run
    still reads stays: the learn stage starts from iteration ``k``'s checkpoint, one-step off-policy
    rollouts play ``k - 1``'s, and the best and final policies are validated steps and the last one.
    Returns the iterations pruned now."""
    from ragen_core.learner.checkpoint_pruning import prune_weights

    keep = cfg.trainer.keep_policies
    if keep is None:
        return []
    reason = f"pruned after iteration {k} (trainer.keep_policies={keep})"
    return [
        j
        for j in range(1, k - keep + 1)
        if not (eval_due(cfg, j) or run.eval_metrics_file(j).exists())
        and prune_weights(run.checkpoint(j), reason)
    ]


def prune_checkpoints(cfg: RagenConfig, run: RunDir, k: int) -> None:
    """After iteration ``k``: what ``trainer.keep_optimizer_states`` and ``trainer.keep_policies`` drop."""
    prune_optimizer_states(cfg, run, k)
    prune_policies(cfg, run, k)


def finish_iteration(run: RunDir, k: int, metrics: Mapping[str, float]) -> None:
    atomic_write_text(run.metrics_file(k), json.dumps(dict(metrics), indent=1, sort_keys=True))
    # The empty mark carries no data to corrupt: one SHA256SUMS rewrite (and fsync) less per iteration.
    atomic_write_text(run.done_file(k), "", record_digest=False)
