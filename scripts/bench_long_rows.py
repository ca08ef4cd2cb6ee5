"""A/B of the row kernels' long-row programs (kernels/training/train_rowfwd.py) on one GPU.

    python scripts/bench_long_rows.py                                  # inference 4096 16384 131072, train 16384
    python scripts/bench_long_rows.py --tokens 16384 --prefix 512 --train-tokens --out long_rows.json
    python scripts/bench_long_rows.py --limits 32 64 128             # the threshold (LONG_ROW) swept

The row kernels walk each token row's sparse entries serially; a row with many entries (paper-like
inputs: 0.2% dense rows with ~300 cold entries where the mean is ~12) launched late can decide when the
kernel ends. With long-row programs ('on', the default) such rows start first; 'off' walks every row in
row order (kernels.training.train_rowfwd.set_long_rows(False)); --limits sets the threshold of 'on'
(kernels.training.train_rowfwd.LONG_ROW, rows with more entries are long). Per shape and setting, on paper-like inputs
(d_model 2048, d_ff 5632):

* inference (twell_ffn_inference, csr schedule, hot prefix P; units stored most-firing first on 4096
  untimed calibration rows as bench_ffn.py --hot-prefix does): the FFN replayed from a CUDA graph, the
  row kernel's GPU time in one profiled call, and dense cuBLAS on the same inputs;
* training (twell_ffn forward + backward with its L1 term, default hot units; 'long' counts rows past
  the threshold without the batch's hot units, as the op's CSR holds them): the step in one CUDA
  graph (benchlib.graphed_step, as bench_train.py --cuda-graph), and the forward row kernel and the dx
  kernel in one profiled eager step.

Both settings must give the same bits (each row is summed by one program in entry order either way):
'same' checks y (and for training dx) on vs off with torch.equal; every result is also checked against a
float32 reference (inference per row < 1e-2; training: y and every gradient within 3x the dense bf16
step's own error or 1e-2, benchlib.within_tolerance as in bench_train.py).
"""

from __future__ import annotations

import argparse
import sys

import torch
from benchlib import (
    ROW_TOLERANCE,
    dense_ffn_l1,
    graphed_step,
    kernel_times,
    ordered_inputs,
    prepare_step,
    row_errors,
    step_errors,
    synthetic_inputs,
    timed,
    train_step,
    twell_y_l1,
    within_tolerance,
    write_results,
)

from twell.kernels import twell_ffn_inference
from twell.kernels.reference import relu_ffn_inference as dense_ffn
from twell.kernels.training import train_rowfwd
from twell.kernels.training.train import hot_units_for

SETTINGS = ("off", "on")  # 'on' at LONG_ROW = --limit


def _kernel_us(kernels: list[dict], name: str) -> float:
    """GPU us of the kernels in a kernel_times() list whose name contains `name`."""
    return sum(k["us"] for k in kernels if name in k["kernel"])


def _long_count(x, w_gate, P: int = 0, hot: int = 0) -> int:
    """Rows whose cold positives exceed the long-row threshold: units P and up, less the batch's `hot`
    most-firing units (the training op's hot units)."""
    pos = (x @ w_gate.T) > 0
    cold = pos[:, P:]
    if hot:
        cold = cold.clone()
        cold[:, pos.sum(0).topk(min(hot, pos.shape[1])).indices] = False
    return int((cold.sum(1) > train_rowfwd.LONG_ROW).sum())


def bench_inference(M: int, P: int, D: int, F: int, rep: int) -> dict:
    x, w_gate, w_up, w_down = ordered_inputs(M, D, F)
    row = dict(mode="inference", tokens=M, d_model=D, d_ff=F, prefix=P, long_rows=_long_count(x, w_gate, P))
    call = lambda: twell_ffn_inference(x, w_gate, w_up, w_down, hot_prefix=P)  # noqa: E731
    ys = {}
    with torch.no_grad():
        row["dense_ms"] = timed(lambda: dense_ffn(x, w_gate, w_up, w_down), True, rep)
        for setting in SETTINGS:
            train_rowfwd.set_long_rows(setting == "on")
            try:
                ys[setting] = call()
                row[f"{setting}_err"] = float(row_errors(ys[setting], x, w_gate, w_up, w_down).max())
                row[f"{setting}_ms"] = timed(call, True, rep)
                row[f"{setting}_row_kernel_us"] = _kernel_us(kernel_times(call)[0], "_row_fwd_kernel")
            finally:
                train_rowfwd.set_long_rows(True)
    row["same"] = bool(torch.equal(ys["on"], ys["off"]))
    row["ok"] = row["same"] and all(row[f"{s}_err"] < ROW_TOLERANCE for s in SETTINGS)
    return row


def bench_train(M: int, D: int, F: int, rep: int) -> dict:
    inputs = synthetic_inputs(M, D, F)[0]
    hot = hot_units_for(M, F)
    row = dict(mode="train", tokens=M, d_model=D, d_ff=F, prefix=0, hot_units=hot)
    row["long_rows"] = _long_count(inputs[0], inputs[1], hot=hot)
    leaves, grad_y, ref = prepare_step(inputs)
    dense = step_errors(dense_ffn_l1, leaves, grad_y, ref)  # the dense bf16 step's own errors: the bar
    got = {}
    for setting in SETTINGS:
        train_rowfwd.set_long_rows(setting == "on")
        try:
            y = train_step(twell_y_l1, leaves, grad_y).detach().clone()
            got[setting] = (y, leaves[0].grad.clone())
            g = graphed_step(twell_y_l1, leaves, grad_y, ref, rep, twell=True)
            row[f"{setting}_ms"] = g["graph_fwd_bwd_ms"]
            errs = {k.removeprefix("graph_"): v for k, v in g.items() if k.startswith("graph_err_")}
            row[f"{setting}_err"] = max(errs.values())
            row[f"{setting}_within"] = all(within_tolerance(v, dense[k]) for k, v in errs.items())
            row[f"{setting}_misses"] = g["graph_misses"]
            kernels, _ = kernel_times(lambda: train_step(twell_y_l1, leaves, grad_y))
            row[f"{setting}_row_kernel_us"] = _kernel_us(kernels, "_row_fwd_kernel")
            row[f"{setting}_dx_kernel_us"] = _kernel_us(kernels, "_row_dx_kernel")
        finally:
            train_rowfwd.set_long_rows(True)
    row["same"] = all(torch.equal(a, b) for a, b in zip(got["on"], got["off"]))
    row["dense_errs"] = dense
    row["ok"] = row["same"] and all(row[f"{s}_within"] and not row[f"{s}_misses"] for s in SETTINGS)
    return row


def print_row(r: dict) -> None:
    kern = f"{r['off_row_kernel_us']:8.1f} {r['on_row_kernel_us']:8.1f}"
    if r["mode"] == "train":
        kern += f"  dx {r['off_dx_kernel_us']:7.1f} {r['on_dx_kernel_us']:7.1f}"
        base = ""
    else:
        base = f"  dense {r['dense_ms']:7.3f} -> x{r['dense_ms'] / r['off_ms']:.2f} / x{r['dense_ms'] / r['on_ms']:.2f}"
    print(
        f"{r['mode']:<9} {r['tokens']:>7} {r['prefix']:>4} {r['long_rows']:>5} {r['off_ms']:8.3f} {r['on_ms']:8.3f} "
        f"{kern}{base}  same {'yes' if r['same'] else 'NO'} ok {'yes' if r['ok'] else 'NO'}",
        flush=True,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[4096, 16384, 131072], help="inference")
    p.add_argument("--prefix", type=int, nargs="*", default=[0, 512], help="inference hot prefix P")
    p.add_argument("--train-tokens", type=int, nargs="*", default=[16384])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument(
        "--limits", type=int, nargs="*", default=[train_rowfwd.LONG_ROW], help="long-row thresholds for 'on'"
    )
    p.add_argument("--rep", type=int, default=100, help="ms of timing per measurement")
    p.add_argument("--out", default="bench_long_rows.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_long_rows.py needs a CUDA GPU")
    print("ms: graph-replayed, off / on; us: the row kernel (and dx) in one profiled call, off / on")
    print(
        f"{'mode':<9} {'tokens':>7} {'P':>4} {'long':>5} {'off ms':>8} {'on ms':>8} {'off us':>8} {'on us':>8}"
    )
    rows, default = [], train_rowfwd.LONG_ROW
    for limit in args.limits:
        train_rowfwd.LONG_ROW = limit
        print(f"LONG_ROW {limit}")
        try:
            for M in args.tokens:
                for P in args.prefix:
                    rows.append(dict(bench_inference(M, P, args.d_model, args.d_ff, args.rep), limit=limit))
                    print_row(rows[-1])
                    torch.cuda.empty_cache()
            for M in args.train_tokens:
                rows.append(dict(bench_train(M, args.d_model, args.d_ff, args.rep), limit=limit))
                print_row(rows[-1])
                torch.cuda.empty_cache()
        finally:
            train_rowfwd.LONG_ROW = default
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
