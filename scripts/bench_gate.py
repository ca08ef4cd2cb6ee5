"""Gate GEMM micro-benchmark: where does twell_gate's time go (mainloop or compaction epilogue)?

    python scripts/bench_gate.py --out bench_gate.json

Per token count, times cuBLAS (x @ w_gate.T, and with relu) against our gate kernel per variant:
loads (tma | ptr) x grid (tiles | persistent) x epilogue (counts: mainloop + a per-row count only;
dense: relu stored dense like a plain GEMM; twell: the real compaction). TF/s counts 2 M D F.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.gate import (  # noqa: E402
    _TUNED,
    _regime,
    default_slots,
    default_tile_n,
    launch_gate,
    set_gate_variant,
)
from kernels.synthetic import paper_like_ffn_inputs  # noqa: E402

VARIANTS = [  # (loads, persistent, epilogue)
    ("tma", False, "counts"),
    ("tma", False, "dense"),
    ("tma", False, "twell"),
    ("tma", True, "counts"),
    ("tma", True, "twell"),
    ("ptr", False, "counts"),
    ("ptr", False, "twell"),
]


def bench_shape(M, D, F, rep, variants):
    import triton

    x, wg, _, _ = paper_like_ffn_inputs(M, D, F, device="cuda", seed=M + F)
    flop = 2.0 * M * D * F
    out = []

    def row(name, ms, **extra):
        r = dict(tokens=M, d_model=D, d_ff=F, variant=name, ms=ms, tflops=flop / (ms * 1e9), **extra)
        print(
            f"{M:>7} {F:>5} {name:<26} {ms:8.3f} ms {r['tflops']:7.1f} TF/s {extra.get('config', '')}",
            flush=True,
        )
        out.append(r)

    row("cublas x@w.T", triton.testing.do_bench(lambda: x @ wg.T, rep=rep, return_mode="median"))
    row(
        "cublas relu(x@w.T)",
        triton.testing.do_bench(lambda: torch.relu(x @ wg.T), rep=rep, return_mode="median"),
    )
    tile_n = default_tile_n(M, F)
    slots = tile_n if M <= 64 else default_slots(tile_n)
    T = -(-F // tile_n)
    counts = torch.empty((M, T), dtype=torch.int32, device="cuda")
    cols = torch.empty((M, T, slots), dtype=torch.int16, device="cuda")
    vals = torch.empty((M, T, slots), dtype=x.dtype, device="cuda")
    dense = torch.empty((M, F), dtype=x.dtype, device="cuda")
    for loads, persistent, epi in variants:
        if M <= 64 and (persistent or epi != "twell"):
            continue
        set_gate_variant(loads=loads, persistent=persistent)
        fn = lambda e=epi: launch_gate(x, wg, counts, cols, vals, tile_n, slots, epilogue=e, dense=dense)
        try:
            fn()
            ms = triton.testing.do_bench(fn, rep=rep, return_mode="median")
        except Exception as e:  # a variant that does not compile here is a result, not a crash
            print(f"{M:>7} {F:>5} {loads}/{persistent}/{epi}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        best = _TUNED[_regime(M)].best_config
        name = f"{loads}{'+pers' if persistent else ''} {epi} n{tile_n}"
        row(name, ms, config=str(best))
    set_gate_variant()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[131072, 16384, 64, 1])
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--rep", type=int, default=60, help="ms of timing per measurement")
    p.add_argument("--out", default="bench_gate.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gate.py needs a CUDA GPU")
    rows = []
    for M in args.tokens:
        rows += bench_shape(M, args.d_model, args.d_ff, args.rep, VARIANTS)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
