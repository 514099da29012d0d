"""Importing ragen_core (or flows) before torch puts MKL in its reproducible mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragen_core import CPU_NUMERICS_ENV, PORTABLE_NUMERICS_ENV, PORTABLE_SWITCH

ROOT = Path(__file__).resolve().parents[2]
MATMUL = "import torch; a = torch.ones(64, 64); a @ a"


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, with none of the numerics variables but those in ``env``."""
    pinned = {*CPU_NUMERICS_ENV, *PORTABLE_NUMERICS_ENV, PORTABLE_SWITCH}
    clean = {k: v for k, v in os.environ.items() if k not in pinned}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **env},
    )


def mkl_verbose(code: str, **env: str) -> str:
    out = python(code, MKL_VERBOSE="1", **env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "GEMM" in line]
    assert lines, "torch's matmul did not go through MKL: " + (out.stdout + out.stderr)[-2000:]
    return lines[0]


@pytest.mark.parametrize("entry", ["ragen_core", "flows"])
def test_import_pins_mkl_to_reproducible_mode(entry: str) -> None:
    line = mkl_verbose(f"import {entry}; {MATMUL}")
    assert "CNR:AUTO" in line and "Dyn:0" in line, line


def test_without_the_import_mkl_is_free_to_vary() -> None:
    """The control: what the pin changes (MKL's defaults choose kernels and threads at run time)."""
    line = mkl_verbose(MATMUL)
    assert "CNR:OFF" in line and "Dyn:1" in line, line


def test_a_value_in_the_environment_wins() -> None:
    line = mkl_verbose(f"import ragen_core; {MATMUL}", MKL_CBWR="COMPATIBLE")
    assert "CNR:COMPATIBLE" in line, line


def test_portable_numerics_ask_every_library_for_its_cpu_independent_code() -> None:
    """RAGEN_PORTABLE_NUMERICS=1: MKL's COMPATIBLE path and ATen's scalar kernels (and oneDNN's SSE4.1);
    that they give the same run on two CPU kinds is benchmarks/cross_machine.py's measurement."""
    code = f"import ragen_core, torch; print('capability', torch.backends.cpu.get_cpu_capability()); {MATMUL}"
    line = mkl_verbose(code, **{PORTABLE_SWITCH: "1"})
    assert "CNR:COMPATIBLE" in line, line
    out = python(code, **{PORTABLE_SWITCH: "1"})
    assert "capability DEFAULT" in out.stdout, out.stdout + out.stderr[-1000:]
    bad = python("import ragen_core", **{PORTABLE_SWITCH: "yes"})
    assert bad.returncode != 0 and f"{PORTABLE_SWITCH}='yes'" in bad.stderr
