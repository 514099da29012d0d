"""ragen-flow's library: environments' groups, rollouts, StarPO algorithms, learner, SFT and tracking.

Importing it pins MKL to its reproducible mode (see :func:`pin_cpu_numerics`), which is why the
entry points (``flows``, the tests' conftest) import it before torch.
"""

from __future__ import annotations

import os

# MKL's "conditional numerical reproducibility" (Intel's Reproducibility Conditions): by default
# (MKL_VERBOSE shows "CNR:OFF Dyn:1") MKL may choose its kernels and its thread count at run time, so
# two CPU runs of the same config can differ in the 8th digit - seen once in the resume test's SFT
# warm start. AUTO keeps the fastest code path this CPU has but fixes it, with a fixed thread count.
# MKL reads these when torch loads it, so this must run before ``import torch``; a value already in
# the environment wins.
CPU_NUMERICS_ENV = {"MKL_CBWR": "AUTO", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}

# AUTO is reproducible on one CPU kind only: PyTorch's own kernels, oneDNN and MKL each pick AVX2 or
# AVX-512 code by what the CPU has, and kernels of different widths add in different orders (an AVX2
# and an AVX-512 machine train different weights from the same config). RAGEN_PORTABLE_NUMERICS=1
# asks every library for the code meant to be the same on any x86-64 CPU: ATen's scalar kernels,
# oneDNN's SSE4.1 path, MKL's COMPATIBLE path, at about 1.5x the compute time. Measured: bitwise the
# same run with the instruction set capped to AVX2 on an AVX-512 Intel Xeon (benchmarks/cross_machine.py),
# but not the same run on an AMD EPYC as on that Xeon (benchmarks/portable_digests.py): it does not
# make runs portable across CPU vendors (benchmarks/README.md).
PORTABLE_SWITCH = "RAGEN_PORTABLE_NUMERICS"
PORTABLE_NUMERICS_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_CBWR": "COMPATIBLE",
}


def pin_cpu_numerics() -> None:
    """Set MKL's reproducible mode in this process's environment (inherited by Ray workers), and with
    ``RAGEN_PORTABLE_NUMERICS=1`` the kernels meant to be the same on every x86-64 CPU."""
    portable = os.environ.get(PORTABLE_SWITCH, "")
    if portable not in ("", "0", "1"):
        raise ValueError(
            f"{PORTABLE_SWITCH}={portable!r}: use 1 (the instruction-set-independent kernels) or 0"
        )
    for key, value in {**CPU_NUMERICS_ENV, **(PORTABLE_NUMERICS_ENV if portable == "1" else {})}.items():
        os.environ.setdefault(key, value)


pin_cpu_numerics()
