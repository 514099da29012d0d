"""Reproducibility across CPUs: what changes a run's numbers from one machine kind to another, and
what pins them.

On one machine the same config and seed give the same run bitwise (``benchmarks/identity.py``;
``ragen_core`` pins MKL to ``MKL_CBWR=AUTO``). Across machines it does not: the math libraries pick
their kernels by the instruction set the CPU has (PyTorch's own ATen kernels, oneDNN and MKL each
dispatch to AVX2 or AVX-512 code), and kernels of different widths add in different orders. An
AVX2-only machine is emulated here by capping each library's instruction set on this one:
``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (what
each library would choose by itself on such a CPU).

Four runs of ``configs/bandit-tiny.yaml`` (SFT warm start + ``--iterations`` iterations, local
backend), each in a fresh state folder:

- native: this machine as it is;
- avx2: the emulated AVX2 machine;
- portable / portable-avx2: both again with ``RAGEN_PORTABLE_NUMERICS=1``, which makes ``ragen_core``
  ask for the kernels that are the same whatever the CPU (``ragen_core.PORTABLE_NUMERICS_ENV``:
  ``ATEN_CPU_CAPABILITY=default``, ATen's non-vectorised kernels; ``ONEDNN_MAX_CPU_ISA=SSE41``;
  ``MKL_CBWR=COMPATIBLE``, MKL's code path meant to give the same results on every x86 CPU; an
  emulation caps the instruction set, not the vendor: ``portable_digests.py`` checks two real machines).

It compares the warm start, every iteration's rollouts and checkpoint and the validation rollouts
(as ``identity.py`` does) between native and avx2 (does a run move across machines?) and between
the two portable runs (do the settings pin it?), and times the portable run against the native one.

Usage: ``python benchmarks/cross_machine.py [--iterations N]`` (default 3). The last lines read
``BENCH cross_machine_identity ratio=<equal artifacts / artifacts, portable runs> target=>=1 PASS|MISS``
and ``BENCH portable_numerics_cost ratio=<portable / native seconds of warm start, generation and
updates> target=<=1.5 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from identity import compare_runs, train  # the sibling benchmark (its folder is on the path now)

from ragen_core import PORTABLE_NUMERICS_ENV, PORTABLE_SWITCH

ROOT = Path(__file__).resolve().parents[1]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
PORTABLE = {PORTABLE_SWITCH: "1"}  # ragen_core then sets PORTABLE_NUMERICS_ENV
COST_TARGET = 1.5


def same_warm_start(a: Path, b: Path) -> tuple[str, bool, str]:
    wa = safetensors.torch.load_file(str(a / "init_policy" / "model.safetensors"))
    wb = safetensors.torch.load_file(str(b / "init_policy" / "model.safetensors"))
    diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
    return (
        "init_policy (warm start)",
        not diff,
        "bitwise equal" if not diff else f"{len(diff)} tensors differ",
    )


def checks(a: Path, b: Path, iterations: int) -> list[tuple[str, bool, str]]:
    return [same_warm_start(a, b), *compare_runs(a, b, iterations)]


def compute_seconds(run: Path, iterations: int) -> float:
    """The run's numeric work, from its own records: the warm start, then each iteration's generation
    and learner update (no process start-up, no servers)."""
    total = float(json.loads((run / "init_policy" / "sft_metrics.json").read_text())["total_seconds"])
    for k in range(1, iterations + 1):
        m = json.loads((run / f"iter_{k:04d}" / "metrics.json").read_text())
        total += m["timing_s/gen"] + m["timing_s/update"]
    return total


def report(title: str, found: list[tuple[str, bool, str]]) -> float:
    print(f"{title}:")
    for name, ok, detail in found:
        print(f"  {name:32s} {'same' if ok else 'DIFFERENT'} ({detail})")
    return sum(ok for _, ok, _ in found) / len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ragen-cross-machine-"))
    try:
        runs: dict[str, Path] = {}
        for name, env in (
            ("native", {}),
            ("avx2", AVX2),
            ("portable", PORTABLE),
            # On an AVX2 machine the switch's ATen and oneDNN settings sit below what the CPU has, so only
            # MKL's instruction cap is left to emulate the hardware (the other two caps would override
            # the switch's lower settings, which no real AVX2 machine does).
            ("portable-avx2", {"MKL_ENABLE_INSTRUCTIONS": AVX2["MKL_ENABLE_INSTRUCTIONS"], **PORTABLE}),
        ):
            print(f"training {name} {env or ''} ...", flush=True)
            if name.startswith("portable"):
                print(f"  ({PORTABLE_SWITCH}=1 sets {PORTABLE_NUMERICS_ENV})", flush=True)
            t0 = time.perf_counter()
            runs[name] = train(ROOT, work / name, args.iterations, env)
            print(
                f"  {time.perf_counter() - t0:.0f} s, of which warm start + generation + updates "
                f"{compute_seconds(runs[name], args.iterations):.1f} s",
                flush=True,
            )
        moved = report(
            "native vs avx2 (default settings, two CPU kinds)",
            checks(runs["native"], runs["avx2"], args.iterations),
        )
        pinned = report(
            "portable vs portable-avx2 (portable settings, two CPU kinds)",
            checks(runs["portable"], runs["portable-avx2"], args.iterations),
        )
        cost = compute_seconds(runs["portable"], args.iterations) / compute_seconds(
            runs["native"], args.iterations
        )
        print(
            f"same across CPU kinds: {moved:.2f} of the artifacts with the default settings, {pinned:.2f} "
            f"with the portable ones; the warm start, generation and updates take {cost:.2f}x as long portable"
        )
        print(
            f"BENCH cross_machine_identity ratio={pinned:.2f} target=>=1 {'PASS' if pinned >= 1 else 'MISS'}"
        )
        print(
            f"BENCH portable_numerics_cost ratio={cost:.2f} target=<={COST_TARGET:g} "
            f"{'PASS' if cost <= COST_TARGET else 'MISS'}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
