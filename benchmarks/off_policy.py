"""One-step off-policy rollouts (``trainer.off_policy_steps: 1``) against synchronous training, on the
Ray backend: iteration wall time, and learning curves over seeds.

Speed: ``ragen train configs/bandit-tiny.yaml`` (the CLI, the Prefect flow, Ray actors: one rollout
actor and one learner, 1 CPU each) for ``--iterations`` iterations with validation only at the
end, synchronous and one-step off-policy alternating in ABBA order, ``--repeats`` times each, every
run in a fresh state folder. An iteration's wall time is the time between the DONE marks of
iterations k - 1 and k (everything the flow does for it: its stage tasks, the checkpoint, the
monitor, queueing the MLflow logging); iterations 1 and 2 are left out (first calls, and iteration 1
of an off-policy run plays its own rollouts before the overlap starts). The headline is the median
iteration time off-policy over the median synchronous (target <= 0.7, where generation and learning
take similar time: their medians are printed). On 2 cores the two actors take both, so the flow's
own work and the MLflow logging process compete with them.

Curves (``--curves``): the same config, full length (its 30 iterations, validation every 5), for
``--seeds`` run seeds (``trainer.seed``; the warm start is the config's own, shared), both modes; the
validation success at every validated step as mean +- std over the seeds. The headline compares
the final success (target: the off-policy mean >= 0.95 x the synchronous mean; 128 validation
episodes have a standard error of up to 0.044).

Usage: ``python benchmarks/off_policy.py [--iterations N] [--repeats R] [--curves] [--seeds S]``. Each
part ends with its ``BENCH`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "bandit-tiny.yaml"
MODES = {"sync": "0", "off-policy": "1"}


def train(state: Path, name: str, sets: list[str]) -> Path:
    """One ``ragen train`` run in ``state``; returns its run folder."""
    args = [sys.executable, "-m", "flows.cli", "train", str(CONFIG), "--name", name]
    args += [x for s in ["trainer.backend=ray", *sets] for x in ("--set", s)]
    env = {**os.environ, "RAGEN_STATE_DIR": str(state)}
    t0 = time.perf_counter()
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    runs = [p for p in (state / "runs").iterdir() if p.name.startswith(name)]
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return runs[0]


def iteration_seconds(run: Path, first: int = 3) -> list[float]:
    """Wall time of iterations ``first``..N, from the DONE marks of k - 1 and k."""
    marks = sorted(run.glob("iter_*/DONE"))
    times = [m.stat().st_mtime for m in marks]
    return [b - a for a, b in zip(times[first - 2 :], times[first - 1 :], strict=False)]


def stage_seconds(run: Path, key: str, first: int = 3) -> list[float]:
    files = sorted(run.glob("iter_*/metrics.json"))[first - 1 :]
    return [json.loads(f.read_text())[key] for f in files]


def speed(iterations: int, repeats: int) -> None:
    sets = [f"trainer.iterations={iterations}", "trainer.eval_every=0"]
    pairs = (("sync", "off-policy"), ("off-policy", "sync"))  # ABBA: a drift of the machine cancels
    order = [mode for r in range(repeats) for mode in pairs[r % 2]]
    per_mode: dict[str, dict[str, list[float]]] = {m: {"iter": [], "gen": [], "update": []} for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-off-policy-") as tmp:
        for i, mode in enumerate(order):
            run = train(Path(tmp) / f"{i}", f"{mode}-{i}", [*sets, f"trainer.off_policy_steps={MODES[mode]}"])
            per_mode[mode]["iter"] += iteration_seconds(run)
            per_mode[mode]["gen"] += stage_seconds(run, "timing_s/gen")
            per_mode[mode]["update"] += stage_seconds(run, "timing_s/update")
    med = {m: {k: statistics.median(v) for k, v in parts.items()} for m, parts in per_mode.items()}
    for mode, parts in med.items():
        print(
            f"{mode:>10}: iteration {parts['iter']:.3f} s (median of {len(per_mode[mode]['iter'])}), "
            f"generation {parts['gen']:.3f} s, update {parts['update']:.3f} s"
        )
    ratio = med["off-policy"]["iter"] / med["sync"]["iter"]
    print(f"BENCH off_policy_iteration ratio={ratio:.2f} target=<=0.7 {'PASS' if ratio <= 0.7 else 'MISS'}")


def curves(seeds: int) -> None:
    success: dict[str, list[dict[int, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-off-policy-curves-") as tmp:
        for seed in range(seeds):
            for mode, steps in MODES.items():
                sets = [f"trainer.seed={seed}", f"trainer.off_policy_steps={steps}"]
                run = train(Path(tmp) / f"{mode}-{seed}", f"{mode}-{seed}", sets)
                success[mode].append(
                    {
                        int(f.stem.split("_")[1]): json.loads(f.read_text())["val-env/success"]
                        for f in sorted((run / "eval").glob("step_*.json"))
                    }
                )
    steps = sorted(success["sync"][0])
    print("validation success, mean +- std over seeds " + " ".join(f"{s:>13}" for s in steps))
    means = {}
    for mode, runs in success.items():
        cells = []
        for s in steps:
            values = [r[s] for r in runs]
            cells.append(
                f"{statistics.mean(values):.3f}+-{statistics.stdev(values) if len(values) > 1 else 0:.3f}"
            )
        means[mode] = statistics.mean(r[steps[-1]] for r in runs)
        print(f"{mode:>43} " + " ".join(f"{c:>13}" for c in cells))
    ratio = means["off-policy"] / max(means["sync"], 1e-9)
    print(
        f"BENCH off_policy_final_success ratio={ratio:.2f} target=>=0.95 {'PASS' if ratio >= 0.95 else 'MISS'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode for the speed part")
    ap.add_argument("--curves", action="store_true", help="also the learning curves over seeds")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--no-speed", action="store_true", help="only the curves")
    args = ap.parse_args()
    if not args.no_speed:
        speed(args.iterations, args.repeats)
    if args.curves:
        curves(args.seeds)


if __name__ == "__main__":
    main()
