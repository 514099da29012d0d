"""Behaviour check for refactors: the same config trains the same run before and after a change.

Trains ``configs/bandit-tiny.yaml`` (``--iterations`` iterations, local backend) twice, once with the
code of a reference revision (checked out into a temporary ``git worktree``) and once with the code of
this working tree, each in a fresh state folder, with the same interpreter and packages. Then it
compares, iteration by iteration:

- the train rollouts (``iter_K/rollouts.parquet``) and the validation rollouts (``eval/*.parquet``):
  every column of every row equal, except ``run_id`` (a run id holds the config hash and a random
  suffix, so it differs between any two runs, and the config hash changes whenever a config field is
  added) and ``iteration``, which each side must number as its trajectory schema says: ``K`` for
  iteration K's rollouts and the step for validation (v2), or the 0-based seed round, ``K - 1`` and
  0, in v1 files (written before 2026-12-02);
- the learner state after each iteration (``iter_K/checkpoint``): every tensor of the policy (and
  critic) bitwise equal.

Usage: ``python benchmarks/identity.py [--ref REV] [--iterations N]`` (default: ``HEAD``, 3). The last
line reads ``BENCH identity_<ref> ratio=<equal artifacts / artifacts> target=>=1 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import safetensors.torch
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/bandit-tiny.yaml"


def train(code: Path, state: Path, iterations: int, extra_env: dict[str, str] | None = None) -> Path:
    """One run of CONFIG with the code in ``code`` (and ``extra_env`` set); returns its run directory."""
    env = {
        **os.environ,
        "RAGEN_STATE_DIR": str(state),
        "PYTHONPATH": str(code),
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    args = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        CONFIG,
        "--set",
        f"trainer.iterations={iterations}",
        "--set",
        "trainer.backend=local",
        "--set",
        f"trainer.run_root={state / 'runs'}",
    ]
    log = state / "train.log"
    state.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        code_rc = subprocess.run(args, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code_rc != 0:
        sys.exit(f"training with the code in {code} failed (rc {code_rc}); see {log}")
    (run,) = [p for p in (state / "runs").iterdir() if p.is_dir()]
    return run


def iteration_numbered(table: pa.Table, k: int, split: str) -> bool:
    """Every row carries the iteration number its file's trajectory schema version prescribes."""
    version = (table.schema.metadata or {}).get(b"ragen.trajectory_schema_version", b"").decode()
    want = k if version == "2" else (k - 1 if split == "train" else 0)
    return set(table.column("iteration").to_pylist()) == {want}


def same_table(a: Path, b: Path, k: int, split: str) -> tuple[bool, str]:
    ta, tb = pq.read_table(a), pq.read_table(b)
    bad = [str(p) for p, t in ((a, ta), (b, tb)) if not iteration_numbered(t, k, split)]
    if bad:
        return False, f"iteration column misnumbered in {bad}"
    ta, tb = ta.drop_columns(["run_id", "iteration"]), tb.drop_columns(["run_id", "iteration"])
    if ta.schema.remove_metadata() != tb.schema.remove_metadata():
        return False, "different schemas"
    if ta.num_rows != tb.num_rows:
        return False, f"{ta.num_rows} vs {tb.num_rows} rows"
    diff = [c for c in ta.column_names if not ta.column(c).equals(tb.column(c))]
    return not diff, "equal" if not diff else f"columns differ: {diff}"


def same_weights(a: Path, b: Path) -> tuple[bool, str]:
    files = ["policy/model.safetensors", "critic.safetensors"]
    for name in files:
        fa, fb = a / name, b / name
        if fa.exists() != fb.exists():
            return False, f"{name} on one side only"
        if not fa.exists():
            continue
        wa, wb = safetensors.torch.load_file(str(fa)), safetensors.torch.load_file(str(fb))
        if wa.keys() != wb.keys():
            return False, f"{name}: different tensors"
        diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
        if diff:
            return False, f"{name}: {len(diff)} tensors differ, e.g. {diff[:2]}"
    return True, "bitwise equal"


def compare_runs(ref_run: Path, new_run: Path, iterations: int) -> list[tuple[str, bool, str]]:
    """(artifact, equal, detail) for every iteration's rollouts and checkpoint and every validation file."""
    checks: list[tuple[str, bool, str]] = []
    for k in range(1, iterations + 1):
        it = f"iter_{k:04d}"
        checks.append(
            (
                f"{it}/rollouts.parquet",
                *same_table(ref_run / it / "rollouts.parquet", new_run / it / "rollouts.parquet", k, "train"),
            )
        )
        checks.append(
            (f"{it}/checkpoint", *same_weights(ref_run / it / "checkpoint", new_run / it / "checkpoint"))
        )
    for f in sorted((ref_run / "eval").glob("*.parquet")):
        step = int(f.stem.removeprefix("step_"))
        checks.append((f"eval/{f.name}", *same_table(f, new_run / "eval" / f.name, step, "val")))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="reference revision (default HEAD)")
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ragen-identity-"))
    ref_code = work / "ref-code"
    try:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(ref_code), args.ref], check=True
        )
        print(
            f"training {CONFIG} for {args.iterations} iterations with {args.ref} and with this tree ...",
            flush=True,
        )
        ref_run = train(ref_code, work / "ref-state", args.iterations)
        new_run = train(ROOT, work / "new-state", args.iterations)
        checks = compare_runs(ref_run, new_run, args.iterations)
        for name, ok, detail in checks:
            print(f"  {name:32s} {'same' if ok else 'DIFFERENT'} ({detail})")
        ratio = sum(ok for _, ok, _ in checks) / len(checks)
        print(f"BENCH identity_{args.ref} ratio={ratio:.2f} target=>=1 {'PASS' if ratio >= 1 else 'MISS'}")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(ref_code)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
