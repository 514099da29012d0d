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


def pin_cpu_numerics() -> None:
    """Set MKL's reproducible mode in this process's environment (inherited by Ray workers)."""
    for key, value in CPU_NUMERICS_ENV.items():
        os.environ.setdefault(key, value)


pin_cpu_numerics()
