"""Reproducibility across physical machines, checked one machine at a time: digests of a portable run.

``benchmarks/cross_machine.py`` shows that ``RAGEN_PORTABLE_NUMERICS=1`` pins a run's numbers across
CPU kinds, with the other kind emulated on one machine. This script lets two real machines compare,
even when they never meet: it trains ``configs/bandit-tiny.yaml`` (SFT warm start + ``--iterations``
iterations, local backend, ``RAGEN_PORTABLE_NUMERICS=1``) and reduces every artifact to a sha256 of
its content: the warm start's and each checkpoint's tensors (name, dtype, shape, bytes, in name
order), and each rollouts and validation table without its ``run_id`` and ``iteration`` columns
(the Arrow IPC stream of the rest). ``--record FILE`` writes them with this machine's CPU (model name,
AVX-512 or not); ``--check FILE`` trains again and compares with a file recorded elsewhere.

Both also record ``benchmarks/numerics_probes.py``'s digests of the primitives the run is made of
(tokenizer, init, random draws, elementwise maths, matrix products, attention, one training step),
so that two machines whose runs differ see which primitive parts them first. A file recorded
before the probes existed has none; they are then reported as not recorded there.

The digests also follow the code and the pinned packages: re-record when a change that moves the
numbers on purpose lands (``benchmarks/identity.py`` tells whether one did).

Usage: ``python benchmarks/portable_digests.py --record benchmarks/data/portable_digests.json`` or
``--check benchmarks/data/portable_digests.json``. ``--check`` ends with
``BENCH portable_cross_machine ratio=<equal artifacts / artifacts> target=>=1 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from identity import train  # the sibling benchmark (its folder is on the path now)

from ragen_core import PORTABLE_SWITCH

ROOT = Path(__file__).resolve().parents[1]


def probe_digests() -> dict[str, str]:
    """``numerics_probes.py`` in a fresh process with the switch set (the libraries read it at load).
    ``-P``: the benchmarks folder stays off the path (its envs.py would hide the envs package)."""
    env = {**os.environ, PORTABLE_SWITCH: "1", "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "benchmarks" / "numerics_probes.py")
    done = subprocess.run(
        [sys.executable, "-P", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def cpu() -> dict[str, object]:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?"
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []
    )

    def field(name: str) -> str:
        return next(
            (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(name)), "?"
        )

    # Cores and siblings (logical CPUs per socket): a 2-CPU machine may be 2 cores or 1 core with 2
    # hyper-threads, and the thread count the libraries default to may follow either.
    return {
        "model": model,
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "cores": field("cpu cores"),
        "siblings": field("siblings"),
    }


NUMERIC_PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "safetensors", "pyarrow")


def software() -> dict[str, str]:
    """What else decides the numbers: the C library (libm's maths) and the numeric packages."""
    found = {
        "glibc": "-".join(platform.libc_ver()),
        "python": platform.python_version(),
        # a reduction split over another number of threads adds in another order
        "torch_threads": str(torch.get_num_threads()),
    }
    found.update({name: importlib.metadata.version(name) for name in NUMERIC_PACKAGES})
    return found


def tensors_digest(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        if not f.exists():
            continue
        for name, t in sorted(safetensors.torch.load_file(str(f)).items()):
            h.update(f"{f.name}/{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def table_digest(path: Path) -> str:
    table = pq.read_table(path).drop_columns(["run_id", "iteration"])
    table = table.replace_schema_metadata(None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def digests(run: Path, iterations: int) -> dict[str, str]:
    out = {"init_policy": tensors_digest(run / "init_policy" / "model.safetensors")}
    for k in range(1, iterations + 1):
        it = run / f"iter_{k:04d}"
        out[f"iter_{k:04d}/rollouts"] = table_digest(it / "rollouts.parquet")
        out[f"iter_{k:04d}/checkpoint"] = tensors_digest(
            it / "checkpoint" / "policy" / "model.safetensors", it / "checkpoint" / "critic.safetensors"
        )
    for f in sorted((run / "eval").glob("step_*.parquet")):
        out[f"eval/{f.stem}"] = table_digest(f)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, help="write this machine's digests here")
    mode.add_argument("--check", type=Path, help="compare this machine's digests with a recorded file")
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ragen-portable-"))  # kept when the training fails: its log is there
    run = train(ROOT, tmp, args.iterations, {PORTABLE_SWITCH: "1"})
    found = digests(run, args.iterations)
    shutil.rmtree(tmp, ignore_errors=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    probes = probe_digests()
    here = {
        "cpu": cpu(),
        "software": software(),
        "commit": commit.stdout.strip(),
        "iterations": args.iterations,
        "digests": found,
        "probes": probes,
    }
    if args.record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(here, indent=1) + "\n")
        print(
            f"recorded {len(found)} digests and {len(probes)} probes on {here['cpu']} at {here['commit']}"
            f" in {args.record}"
        )
        return
    ref = json.loads(args.check.read_text())
    print(f"recorded on {ref['cpu']} at {ref['commit']}; this machine: {here['cpu']} at {here['commit']}")
    print(f"software there: {ref.get('software', 'not recorded')}; here: {here['software']}")
    there = {**ref.get("software", {}), **ref["cpu"]}
    for key, value in {**here["software"], **here["cpu"]}.items():
        if key in there and there[key] != value and key != "model":
            print(f"  differs: {key} {there[key]} there, {value} here")
    equal = 0
    for name, digest in ref["digests"].items():
        same = found.get(name) == digest
        equal += same
        print(f"  {'equal' if same else 'DIFFERENT':>9}  {name}")
    recorded_probes = ref.get("probes", {})
    print(f"primitives ({len(recorded_probes)} recorded there):")
    for name, digest in probes.items():
        mark = "not recorded" if name not in recorded_probes else "equal"
        if name in recorded_probes and recorded_probes[name] != digest:
            mark = "DIFFERENT"
        print(f"  {mark:>12}  {name}")
    ratio = equal / max(len(ref["digests"]), 1)
    print(f"BENCH portable_cross_machine ratio={ratio:.2f} target=>=1 {'PASS' if ratio >= 1 else 'MISS'}")


if __name__ == "__main__":
    main()
