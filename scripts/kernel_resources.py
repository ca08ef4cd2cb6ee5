"""Registers and spills of the row kernels' autotune configs on a GPU architecture, without a GPU.

Each autotune config of kernels/training/train_rowfwd.py is compiled for the target (sm_90 by default) with
Triton's bundled ptxas and read back with its cuobjdump, for the three ways the kernels run: the training
forward (u stored, L1), inference (entries past the capacity read from h) and the backward's dx pass.
A config that spills (STACK > 0) or needs so many registers that one program fills an SM costs
occupancy on the device; this shows it before any GPU time is spent.

    python scripts/kernel_resources.py [--arch 90] [--d-model 2048] [--d-ff 5632] [--check]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from twell.kernels.training import train_rowfwd as rf

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
REGS_PER_SM = 65536


def resources(fn, signature: dict, constexprs: dict, num_warps: int, arch: int) -> dict:
    """{'regs': per thread, 'stack': bytes of spill stack, 'shared': bytes} of one compiled kernel."""
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run(
            [os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", out)}
    return dict(regs=found["REG"], stack=found["STACK"], shared=found["SHARED"])


def row_kernel_cases(D: int, F: int) -> dict:
    """(kernel, signature, constexprs) per way of running the row kernels, bf16 operands."""
    ptr = lambda t, names: {n: t for n in names}  # noqa: E731
    fwd_sig = {
        **ptr("*i32", ["row_ptr_ptr", "cols_ptr", "hot_pos_ptr"]),
        **ptr("*bf16", ["gate_ptr", "x_ptr", "wu_ptr", "wd_ptr", "y_ptr", "init_ptr", "h_ptr"]),
        **ptr("*fp32", ["up_ptr", "l1_ptr", "l1_init_ptr"]),
        "cap": "i32",
        **ptr("*i32", ["long_count_ptr", "long_list_ptr", "long_slot_ptr"]),
        "n_long_progs": "i32",
    }
    block_d = triton.next_power_of_2(D)
    common = dict(D=D, BLOCK_D=block_d, WHILE_LOOP=False, F=F, LONG_ROW=rf.LONG_ROW)
    # the training op starts y and the L1 sums from zeros (its hot units' share is added after the join)
    train = dict(HAS_L1_INIT=False, HAS_INIT=False, STORE_UP=True, STORE_L1=True, PAST_CAP=False, HOT=False)
    infer = dict(HAS_L1_INIT=False, HAS_INIT=False, STORE_UP=False, STORE_L1=False, PAST_CAP=True, HOT=True)
    dx_sig = {
        **ptr("*i32", ["row_ptr_ptr", "cols_ptr"]),
        **ptr("*fp32", ["dg_ptr", "du_ptr"]),
        **ptr("*bf16", ["wg_ptr", "wu_ptr", "dx_ptr"]),
        **ptr("*i32", ["long_count_ptr", "long_list_ptr", "long_slot_ptr"]),
        "n_long_progs": "i32",
    }
    return {
        "forward (train)": (rf._row_fwd_kernel, fwd_sig, dict(common, **train)),
        "forward (inference)": (rf._row_fwd_kernel, fwd_sig, dict(common, **infer)),
        "dx": (rf._row_dx_kernel, dx_sig, dict(D=D, BLOCK_D=block_d, WHILE_LOOP=False, LONG_ROW=rf.LONG_ROW)),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument("--check", action="store_true", help="exit 1 if any config spills registers")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("TRITON_INTERPRET=1 makes the kernels interpreted functions, which do not compile: unset it")
    if not os.path.exists(os.path.join(BIN, "cuobjdump")):
        sys.exit(f"no cuobjdump in {BIN}: this Triton build has no NVIDIA backend tools (pip install triton)")
    print(
        f"sm_{args.arch}, d_model {args.d_model}: registers a thread, spill stack, programs an SM holds by registers"
    )
    print(f"{'kernel':<20} {'CHUNK':>5} {'warps':>5} {'regs':>5} {'stack':>5} {'progs/SM':>8}")
    spills = []
    for name, (fn, sig, const) in row_kernel_cases(args.d_model, args.d_ff).items():
        for cfg in rf._configs():
            chunk, warps = cfg.kwargs["CHUNK"], cfg.num_warps
            r = resources(fn, sig, dict(const, CHUNK=chunk), warps, args.arch)
            per_warp = -(-r["regs"] * 32 // 256) * 256  # registers are allocated per warp in 256s
            progs = REGS_PER_SM // (per_warp * warps)
            print(f"{name:<20} {chunk:>5} {warps:>5} {r['regs']:>5} {r['stack']:>5} {progs:>8}")
            if r["stack"]:
                spills.append(f"{name} CHUNK {chunk} warps {warps}")
    if args.check and spills:
        sys.exit(f"spilling configs: {', '.join(spills)}")


if __name__ == "__main__":
    main()
