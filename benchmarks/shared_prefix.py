"""The shared prefix (``sft.shared_prefix``, ``learner.shared_prefix``) against the plain pass, on the real model.

Every episode of a multi-turn config begins with the same system prompt and instruction (165 of
FrozenLake's 270-340 tokens with SmolLM2's chat template), and only the answers are trained. The
shared prefix runs those tokens once per batch and repeats their key/value cache over the rows. This
script times, both ways, passes alternating so that a busy machine slows both alike:

- one warm-start step's forward and backward (:func:`~ragen_core.learner.sft.sft_loss`, no optimizer)
  on batches of a config's demonstrations, with the largest loss and gradient gaps;
- one GRPO :meth:`~ragen_core.learner.update.Learner.step` (the config's mini- and micro-batch sizes) on
  ``--rows`` of those episodes as trajectories (random scores in groups of 4), with the largest weight gap
  after it.

Usage: ``python benchmarks/shared_prefix.py [--config C] [--model FOLDER] [--threads N] [--repeats R]``
(default: configs/frozenlake-smollm2-sft.yaml, the imported SmolLM2-135M-Instruct, 2 threads, 3 repeats
of 2 batches). Last lines:
``BENCH sft_shared_prefix_speedup ratio=<plain seconds / shared seconds> target=>=1.5 PASS|MISS`` and
``BENCH learner_shared_prefix_speedup ratio=<plain seconds / shared seconds> target=>=1.3 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragen_core.config import load_config
from ragen_core.learner.batch import TokenBatch
from ragen_core.learner.forward import shared_prefix_length
from ragen_core.learner.sft import build_demonstrations, pad_batch, sft_loss
from ragen_core.learner.update import Learner
from ragen_core.models.policies import load_policy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / ".state" / "models" / "smollm2-135m-instruct"
TARGET = 1.5
LEARNER_TARGET = 1.3  # the update also runs the optimizer, and its rows' own tokens are more of it


def step(model, batch, shared: bool) -> tuple[float, float, torch.Tensor]:
    """Seconds of one forward and backward, the loss, and the flattened gradient."""
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    loss, _ = sft_loss(model, *batch, shared_prefix=shared)
    loss.backward()
    seconds = time.perf_counter() - t
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return seconds, loss.item(), grad


def token_batch(demos, seed: int) -> TokenBatch:
    """The demonstrations as GRPO trajectories: groups of 4, random scores, behaviour log-probs 0."""
    ids, attn, mask = pad_batch(demos, 0)
    g = torch.Generator().manual_seed(seed)
    return TokenBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask.float(),
        turn_index=torch.zeros_like(ids),
        rollout_logprobs=torch.zeros(ids.shape),
        scores=torch.rand(len(demos), generator=g),
        group_ids=torch.arange(len(demos)) // 4,
    )


def learner_steps(cfg, model_dir: str, demos, repeats: int) -> float:
    """Median plain / shared seconds of one learner step from the model's weights (one learner in memory
    at a time); prints the weight gap after each pair."""
    times: dict[bool, list[float]] = {False: [], True: []}
    gap = 0.0
    for r in range(repeats):
        batch = token_batch(demos, seed=r)
        after: dict[bool, dict[str, torch.Tensor]] = {}
        for shared in (False, True) if r % 2 == 0 else (True, False):
            learner = Learner(
                load_policy(model_dir)[0], cfg.learner.model_copy(update={"shared_prefix": shared})
            )
            t = time.perf_counter()
            learner.step(batch)
            times[shared].append(time.perf_counter() - t)
            after[shared] = {k: v.detach().clone() for k, v in learner.policy.state_dict().items()}
            del learner
        gap = max(gap, max(float((after[False][k] - after[True][k]).abs().max()) for k in after[False]))
        del after
        print(
            f"learner step {r}: {tuple(batch.input_ids.shape)} tokens; "
            f"plain {times[False][-1]:.2f} s, shared {times[True][-1]:.2f} s"
        )
    print(f"largest weight gap after a step {gap:.2e}")
    return statistics.median(times[False]) / statistics.median(times[True])


def sft_steps(model, batches, repeats: int) -> float:
    """Median plain / shared seconds of one warm-start step (forward and backward) over the batches."""
    times: dict[bool, list[float]] = {False: [], True: []}
    loss_gap = grad_gap = 0.0
    for r in range(repeats):
        for b, batch in enumerate(batches):
            runs = {}
            for shared in (False, True) if (r + b) % 2 == 0 else (True, False):
                runs[shared] = step(model, batch, shared)
                times[shared].append(runs[shared][0])
            loss_gap = max(loss_gap, abs(runs[True][1] - runs[False][1]))
            grad_gap = max(grad_gap, float((runs[True][2] - runs[False][2]).abs().max()))
            p = shared_prefix_length(batch[0], batch[2], batch[1])
            print(
                f"repeat {r} batch {b}: {tuple(batch[0].shape)} tokens, shared prefix {p}; "
                f"plain {runs[False][0]:.2f} s, shared {runs[True][0]:.2f} s"
            )
    plain, shared = statistics.median(times[False]), statistics.median(times[True])
    print(f"median seconds per warm-start step: plain {plain:.2f}, shared prefix {shared:.2f}")
    print(f"largest loss gap {loss_gap:.2e}, largest gradient gap {grad_gap:.2e} (one element)")
    return plain / shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "frozenlake-smollm2-sft.yaml"))
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16, help="trajectories per learner step")
    ap.add_argument("--skip-sft", action="store_true", help="time the learner steps only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    if cfg.sft is None:
        sys.exit(f"{args.config} has no sft section")
    model, tok = load_policy(args.model)
    model.train()
    size = cfg.sft.batch_size
    sft = cfg.sft.model_copy(update={"episodes_per_tag": max(size * args.batches, args.rows)})
    demos = build_demonstrations(tok, sft, cfg.agent)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batches = [pad_batch(demos[i : i + size], pad) for i in range(0, len(demos), size)][: args.batches]
    ratio = None if args.skip_sft else sft_steps(model, batches, args.repeats)
    del model
    learner_ratio = learner_steps(cfg, args.model, demos[: args.rows], args.repeats)
    if ratio is not None:
        verdict = "PASS" if ratio >= TARGET else "MISS"
        print(f"BENCH sft_shared_prefix_speedup ratio={ratio:.2f} target=>={TARGET} {verdict}")
    verdict = "PASS" if learner_ratio >= LEARNER_TARGET else "MISS"
    print(
        f"BENCH learner_shared_prefix_speedup ratio={learner_ratio:.2f} target=>={LEARNER_TARGET} {verdict}"
    )


if __name__ == "__main__":
    main()
