"""Every autotune config of the row kernels compiles for Hopper (sm_90) without register spills.

Compiled on the CPU with Triton's bundled ptxas (scripts/kernel_resources.py --check, in a process
without TRITON_INTERPRET, which would make the kernels uncompilable interpreted functions), so a kernel
change that makes a config spill, or stop compiling for the GPU at all, fails here before any GPU run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_resources import BIN  # scripts/, on sys.path through tests/conftest.py

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not os.path.exists(os.path.join(BIN, "cuobjdump")), reason="Triton without its NVIDIA tools"
)
def test_row_kernel_configs_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "kernel_resources.py"), "--check"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("forward", "dx"))]
    assert len(rows) == 9, out.stdout  # 3 kernels x 3 configs
