"""The bandwidth floor under the decode gate: how fast one H200 streams a layer's w_gate at all.

    python scripts/bench_decode_floor.py --out decode_floor.json

At 1-64 tokens the TwELL gate is a GEMV over w_gate ([d_ff, d_model] bf16: 23 MB at 5632 x 2048).
Each operation below runs once per layer in one CUDA graph of --layers layers, each on its own copy
of the weight (do_bench flushes L2 before each replay, so every layer reads from HBM), as
bench_ffn.py times decode ('twell/L'): the TwELL decode gate (kernels.inference.inference's format), cuBLAS
x @ w^T, a full fp32 sum of w (a pure read) and a copy of w (a read plus a write). Prints us per
layer and the HBM rate each reaches on w's bytes (the copy: read + written), and writes JSON.
"""

from __future__ import annotations

import argparse
import sys

import torch
from benchlib import timed_layers, write_results

from twell.kernels import twell_gate
from twell.kernels.inference.inference import DECODE_SLOTS, DECODE_TILE_N
from twell.kernels.synthetic import paper_like_ffn_inputs


def _ops(x, ws, dst) -> dict:
    """name -> (call(layer), passes over w's bytes)."""
    return {
        "twell_gate": (lambda i: twell_gate(x, ws[i], tile_n=DECODE_TILE_N, slots=DECODE_SLOTS), 1),
        "cublas_mm": (lambda i: x @ ws[i].T, 1),
        "sum": (lambda i: ws[i].sum(dtype=torch.float32), 1),
        "copy": (lambda i: dst[i].copy_(ws[i]), 2),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--d-ff", type=int, nargs="*", default=[5632, 8192])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rep", type=int, default=100, help="ms of timing per measurement")
    p.add_argument("--out", default="decode_floor.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode_floor.py needs a CUDA GPU")
    rows = []
    print(f"{'tokens':>6} {'d_ff':>5} {'op':<12} {'us/layer':>9} {'TB/s':>6}")
    for F in args.d_ff:
        x_all, w_gate, _, _ = paper_like_ffn_inputs(max(args.tokens), args.d_model, F, device="cuda", seed=F)
        ws = [w_gate] + [w_gate.clone() for _ in range(args.layers - 1)]
        dst = [torch.empty_like(w) for w in ws]
        nbytes = w_gate.numel() * w_gate.element_size()
        for M in args.tokens:
            x = x_all[:M].contiguous()
            for name, (call, passes) in _ops(x, ws, dst).items():
                if name in ("sum", "copy") and M != args.tokens[0]:
                    continue  # no tokens involved
                ms = timed_layers(call, args.layers, args.rep)
                rate = passes * nbytes / (ms * 1e-3) / 1e12
                rows.append(
                    dict(tokens=M, d_ff=F, d_model=args.d_model, op=name, us_per_layer=1e3 * ms, tb_s=rate)
                )
                print(f"{M:>6} {F:>5} {name:<12} {1e3 * ms:9.2f} {rate:6.2f}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
