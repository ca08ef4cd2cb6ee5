"""Benchmark the hot prefix's first GEMM, gated_up = h[:, :P] * (x w_up[:P]^T), on one GPU.

    python scripts/bench_prefix.py                              # tokens 16384 131072, P 256 512
    python scripts/bench_prefix.py --tokens 16384 --prefix 512 --out bench_prefix.json

Per (tokens, P), on paper-like inputs (d_model 2048, d_ff 5632, units stored most-firing first on 4096
untimed calibration rows, as bench_ffn.py --hot-prefix does), every time replayed from a CUDA graph:
'cublas' = x @ w_up[:P]^T alone, 'cublas+mul' = that times h's strided prefix (two kernels),
'ptr' / 'tma' = gated_up with pointer loads or TMA descriptors (kernels.inference.prefix.set_gated_up_loads),
and the whole FFN (twell_ffn_inference, hot_prefix=P) with each of the two against dense cuBLAS.
Every output is checked against a float32 reference (gated_up: max relative error per row; the FFN:
per row, < 1e-2 both).
"""

from __future__ import annotations

import argparse
import sys

import torch
from benchlib import ROW_TOLERANCE, ordered_inputs, row_errors, timed, write_results

from twell.kernels import twell_ffn_inference
from twell.kernels.gate import relu_gate_bits
from twell.kernels.inference import prefix
from twell.kernels.reference import relu_ffn_inference as dense_ffn

LOADS = ("ptr", "tma")


def bench_shape(M: int, P: int, D: int, F: int, rep: int) -> dict:
    x, w_gate, w_up, w_down = ordered_inputs(M, D, F)
    row = dict(tokens=M, d_model=D, d_ff=F, prefix=P)
    with torch.no_grad():
        h = relu_gate_bits(x, w_gate)[0]
        ref = h[:, :P].float() * (x.float() @ w_up[:P].float().T)
        row["cublas_ms"] = timed(lambda: x @ w_up[:P].T, True, rep)
        row["cublas_mul_ms"] = timed(lambda: (x @ w_up[:P].T).mul_(h[:, :P]), True, rep)
        row["dense_ms"] = timed(lambda: dense_ffn(x, w_gate, w_up, w_down), True, rep)
        for loads in LOADS:
            prefix.set_gated_up_loads(loads)
            try:
                out = prefix.gated_up(x, w_up, h, P)
                err = (out.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
                row[f"{loads}_err"] = float(err.max())
                row[f"{loads}_ms"] = timed(lambda: prefix.gated_up(x, w_up, h, P), True, rep)
                y = twell_ffn_inference(x, w_gate, w_up, w_down, hot_prefix=P)
                row[f"ffn_{loads}_err"] = float(row_errors(y, x, w_gate, w_up, w_down).max())
                del y
                row[f"ffn_{loads}_ms"] = timed(
                    lambda: twell_ffn_inference(x, w_gate, w_up, w_down, hot_prefix=P), True, rep
                )
            finally:
                prefix.set_gated_up_loads(None)
    row["ok"] = all(row[f"{k}_err"] < ROW_TOLERANCE for k in ("ptr", "tma", "ffn_ptr", "ffn_tma"))
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[16384, 131072])
    p.add_argument("--prefix", type=int, nargs="*", default=[256, 512])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument("--rep", type=int, default=100, help="ms of timing per measurement")
    p.add_argument("--out", default="bench_prefix.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_prefix.py needs a CUDA GPU")
    print(
        f"{'tokens':>7} {'P':>4} {'cublas':>7} {'+mul':>7} {'ptr':>7} {'tma':>7} {'dense':>7} "
        f"{'ffn ptr':>8} {'ffn tma':>8} {'x ptr':>6} {'x tma':>6} {'max err':>8} ok"
    )
    rows = []
    for M in args.tokens:
        for P in args.prefix:
            r = bench_shape(M, P, args.d_model, args.d_ff, args.rep)
            err = max(r[k] for k in r if k.endswith("_err"))
            print(
                f"{M:>7} {P:>4} {r['cublas_ms']:7.3f} {r['cublas_mul_ms']:7.3f} {r['ptr_ms']:7.3f} "
                f"{r['tma_ms']:7.3f} {r['dense_ms']:7.3f} {r['ffn_ptr_ms']:8.3f} {r['ffn_tma_ms']:8.3f} "
                f"{r['dense_ms'] / r['ffn_ptr_ms']:6.2f} {r['dense_ms'] / r['ffn_tma_ms']:6.2f} {err:8.1e} "
                f"{'yes' if r['ok'] else 'NO'}",
                flush=True,
            )
            rows.append(r)
            torch.cuda.empty_cache()
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
