"""Benchmark the TwELL FFN against dense PyTorch/cuBLAS on one GPU (inference mode, same inputs).

    python scripts/bench_ffn.py --out bench_ffn.json            # tokens 1 64 4096 16384 131072, d_ff 5632
    python scripts/bench_ffn.py --quick --out bench_ffn.json    # tokens 1 64 16384 131072, hot 0 1024, rep 25
    python scripts/bench_ffn.py --hot-units 0 256 512 768       # which dense hot-unit counts to compare
    python scripts/bench_ffn.py --compile --d-ff 5632 8192      # + torch.compile'd dense, more shapes
    python scripts/bench_ffn.py --activations dump.pt            # x, w_gate, w_up, w_down from a real model
    python scripts/bench_ffn.py --mode train                     # training kernels (scripts/bench_train.py)
    python scripts/bench_ffn.py --quick --profile                # + per-kernel GPU times of each variant

Per shape: dense, the gate alone (two-kernel path: dense relu GEMM + compaction), and the FFN for each
schedule (M > 64: --schedules, "csr" the default and "row" the TwELL consumer) and hot-unit count K
(M > 64; K = 0: no hot units), or each consumer split (decode, M <= 64: the row schedule) and, up to
FUSED_MAX_TOKENS tokens, schedule="fused" (the FFN in one kernel).
'hgate' = the hot-split gate alone (row: dense pass + count + top-K + TwELL compaction; csr: the dense
relu+bitmask GEMM alone), 'hmm' = the two hot GEMMs; 'sparse' = FFN - gate - hmm (csr: everything
after the GEMM but the hot GEMMs: count, selection, CSR build, row kernel), with the GB/s the weight
rows of the cold pairs would need if no two tokens shared one. Every configuration is checked row by row against a float32 reference (max
relative error per row < 1e-2). Small batches run under CUDA graphs, timed twice: one FFN per graph
(the graph's launch cost charged to that one FFN) and, per layer, --graph-layers FFNs on their own
weight copies in one graph, as a captured decode step of a model holds its layers ('dense/L',
'twell/L', 'x L').
"""

from __future__ import annotations

import argparse
import sys

import torch
from benchlib import (
    CALIBRATION_ROWS,
    ROW_TOLERANCE,
    BadActivations,
    kernel_times,
    load_activations,
    ordered_weights,
    print_kernel_times,
    row_errors,
    synthetic_inputs,
    timed,
    timed_layers,
    write_results,
)

from twell.kernels import twell_ffn_inference, twell_gate
from twell.kernels.gate import relu_gate_bits, twell_gate_hot
from twell.kernels.inference.inference import (
    DECODE_MAX_TOKENS,
    DECODE_SLOTS,
    DECODE_TILE_N,
    FUSED_MAX_TOKENS,
    FUSED_TILES,
    SCHEDULES,
    _hot_part,
    decode_split,
    default_fused_tokens,
)
from twell.kernels.inference.prefix import gated_up
from twell.kernels.reference import relu_ffn_inference as dense_ffn

GRAPH_MAX_TOKENS = 64


def gate_call(x, w_gate):
    """twell_gate as the row schedule calls it (decode: its own format, DECODE_TILE_N / DECODE_SLOTS)."""
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return twell_gate(x, w_gate, tile_n=DECODE_TILE_N, slots=DECODE_SLOTS)
    return twell_gate(x, w_gate)


def bench_one(inputs, args, compiled, profiles: list | None = None, calibration=None) -> list[dict]:
    """calibration: rows [C, D] of x's distribution (not timed) ordering the units for the hot-prefix
    variants (None: x itself, in-sample)."""
    x, w_gate, w_up, w_down = inputs
    M, D = x.shape
    F = w_gate.shape[0]
    ordered = args.ordered and M <= DECODE_MAX_TOKENS
    cal = x if calibration is None else calibration  # a dump without calibration rows: in-sample
    if ordered:  # as Transformer.order_ffn_units leaves a model: every path runs on the permuted weights
        w_gate, w_up, w_down = ordered_weights(cal, (w_gate, w_up, w_down))[1]
    profiles = [] if profiles is None else profiles
    graph = M <= GRAPH_MAX_TOKENS or args.graph_all
    # Rotate copies of x when everything fits in L2, so the dense path cannot run from a warm cache.
    copies = [x] + [x.clone() for _ in range(3)] if M <= 4096 else [x]
    state = {"i": 0}

    def pick():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    if graph:  # graphs capture fixed pointers: rotation would be meaningless there
        pick = lambda: x
    with torch.no_grad():
        active = (x.float() @ w_gate.float().T > 0).sum(1, dtype=torch.int32)
        mean_active = float(active.float().mean())
        pairs = float(active.sum())
        flops_sparse = 4.0 * D * pairs  # up dot + down axpy per active (row, unit)
        flops_dense = 6.0 * M * D * F
        dense_ms = timed(lambda: dense_ffn(pick(), w_gate, w_up, w_down), graph, args.rep)
        comp_ms = timed(lambda: compiled(pick(), w_gate, w_up, w_down), graph, args.rep) if compiled else None
        gate_ms = timed(lambda: gate_call(x, w_gate), graph, args.rep)
        # Decode inside a captured model step: n layers' FFNs in one graph (distinct weight copies).
        layers = None
        if M <= GRAPH_MAX_TOKENS and args.graph_layers > 1:
            layers = [(w_gate, w_up, w_down)] + [
                tuple(w.clone() for w in (w_gate, w_up, w_down)) for _ in range(args.graph_layers - 1)
            ]
        dense_layer_ms = (
            timed_layers(lambda i: dense_ffn(x, *layers[i]), len(layers), args.rep) if layers else None
        )
        if M <= DECODE_MAX_TOKENS:
            variants = [dict(split=s) if s else {} for s in args.decode_splits]  # 0: the library default
            if M <= FUSED_MAX_TOKENS and not args.no_fused:
                variants.append(dict(schedule="fused"))
                variants += [dict(schedule="fused", fused_tile=t) for t in args.fused_tiles]
        else:
            variants = [dict(schedule=s, hot_units=k) for s in args.schedules for k in args.hot_units]
            variants += [dict(schedule="csr", hot_prefix=p) for p in args.hot_prefix if p]
        pre = x.float() @ w_gate.float().T
        permuted = None
        if any(kw.get("hot_prefix") for kw in variants):
            permuted = ordered_weights(cal, (w_gate, w_up, w_down))
        rows = []
        for kw in variants:
            K = kw.get("hot_units", 0)
            P = kw.get("hot_prefix", 0)
            wts = permuted[1] if P else (w_gate, w_up, w_down)
            hot_gate_ms = hot_mm_ms = None
            cold_pairs = pairs
            if P:  # the prefix's two GEMMs alone as the schedule runs them: onto a cold part's y
                cold_pairs = pairs - float((pre[:, permuted[0][:P]] > 0).sum())
                h_p, y_p = relu_gate_bits(x, wts[0])[0], torch.zeros_like(x)
                hot_mm_ms = timed(
                    lambda w=wts, P=P, h=h_p, y=y_p: torch.addmm(y, gated_up(x, w[1], h, P), w[2][:P]),
                    graph,
                    args.rep,
                )
                del h_p, y_p
            if K:
                hot = twell_gate_hot(x, w_gate, K)
                cold_pairs = pairs - float((pre[:, hot.hot_idx] > 0).sum())
                hot_gate_ms = timed(lambda K=K: twell_gate_hot(x, w_gate, K), graph, args.rep)
                hot_mm_ms = timed(lambda hot=hot: _hot_part(x, w_up, w_down, hot), graph, args.rep)
                del hot
            if kw.get("schedule") == "csr":  # its gate: the relu + bitmask GEMM alone
                hot_gate_ms = timed(lambda: relu_gate_bits(x, w_gate), graph, args.rep)
            y, stats = twell_ffn_inference(x, *wts, return_stats=True, **kw)
            err = row_errors(y, x, *wts)
            del y
            ms = timed(lambda kw=kw, w=wts: twell_ffn_inference(pick(), *w, **kw), graph, args.rep)
            sparse_ms = max(ms - (hot_gate_ms or gate_ms) - (hot_mm_ms or 0.0), 1e-6)
            layer_ms = None
            if layers:
                layer_ms = timed_layers(
                    lambda i, kw=kw: twell_ffn_inference(x, *layers[i], **kw), len(layers), args.rep
                )
            if P:
                name = f"csr-p{P}"
            elif "hot_units" in kw:
                name = f"{kw['schedule']}{K}"
            elif kw.get("schedule") == "fused":
                name = f"fused{kw.get('fused_tile', '')}"  # "fused32": 32 units a program
            elif "split" in kw:  # "s16": split 16 given
                name = f"s{kw['split']}"
            else:  # the default: "d-fused" (the fused kernel) or "d16" (row, which picks split 16 here)
                name = "d-fused" if M <= default_fused_tokens(F) else f"d{decode_split(M)}"
            if args.profile:  # one eager call: per-kernel GPU times (no graph, so launch gaps are not shown)
                kernels, wall = kernel_times(lambda kw=kw, w=wts: twell_ffn_inference(x, *w, **kw))
                print_kernel_times(f"tokens {M}, d_ff {F}, {name}", kernels, wall)
                profiles.append(dict(tokens=M, d_ff=F, variant=name, wall_ms=wall, kernels=kernels))
            rows.append(
                dict(
                    tokens=M,
                    d_model=D,
                    d_ff=F,
                    variant=name,
                    hot_units=K,
                    hot_prefix=P,
                    units_ordered=ordered,
                    cuda_graph=graph,
                    mean_active=mean_active,
                    max_active=int(active.max()),
                    hot_share=1.0 - cold_pairs / max(pairs, 1.0),
                    dense_ms=dense_ms,
                    compiled_ms=comp_ms,
                    twell_ms=ms,
                    gate_ms=gate_ms,
                    hot_gate_ms=hot_gate_ms,
                    hot_mm_ms=hot_mm_ms,
                    sparse_ms=sparse_ms,
                    speedup=dense_ms / ms,
                    speedup_vs_compiled=(comp_ms / ms) if comp_ms else None,
                    graph_layers=len(layers) if layers else None,
                    dense_layer_ms=dense_layer_ms,
                    twell_layer_ms=layer_ms,
                    speedup_layers=(dense_layer_ms / layer_ms) if layers else None,
                    sparse_tflops=4.0 * D * cold_pairs / (sparse_ms * 1e9),
                    sparse_gbs=2.0 * D * x.element_size() * cold_pairs / (sparse_ms * 1e6),
                    useful_tflops_total=flops_sparse / (ms * 1e9),
                    dense_tflops=flops_dense / (dense_ms * 1e9),
                    overflow_rows=int(stats.overflow_rows),
                    max_row_rel_err=float(err.max()),
                    correct=bool(err.max() < ROW_TOLERANCE),
                )
            )
        del pre
        return rows


def print_table(rows):
    head = (
        f"{'tokens':>7} {'d_ff':>5} {'variant':>8} {'graph':>5} {'dense':>8} {'compile':>8} {'twell':>8} "
        f"{'x dense':>7} {'gate':>7} {'hgate':>7} {'hmm':>7} {'sparse':>7} {'hot%':>5} {'sp GB/s':>7} "
        f"{'ovf':>4} {'maxerr':>8} ok {'L':>2} {'dense/L':>8} {'twell/L':>8} {'x L':>5}"
    )
    print(head)
    opt = lambda v, fmt: f"{v:{fmt}}" if v is not None else f"{'-':>{fmt.split('.')[0]}}"  # noqa: E731
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['d_ff']:>5} {r['variant']:>8} {str(r['cuda_graph']):>5} {r['dense_ms']:8.3f} "
            f"{opt(r['compiled_ms'], '8.3f')} {r['twell_ms']:8.3f} {r['speedup']:7.2f} {r['gate_ms']:7.3f} "
            f"{opt(r['hot_gate_ms'], '7.3f')} {opt(r['hot_mm_ms'], '7.3f')} {r['sparse_ms']:7.3f} "
            f"{100 * r['hot_share']:5.1f} {r['sparse_gbs']:7.0f} {r['overflow_rows']:>4} "
            f"{r['max_row_rel_err']:8.2e} {'yes' if r['correct'] else ' NO'} {r.get('graph_layers') or '-':>2} "
            f"{opt(r.get('dense_layer_ms'), '8.4f')} {opt(r.get('twell_layer_ms'), '8.4f')} "
            f"{opt(r.get('speedup_layers'), '5.2f')}",
            flush=True,
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["inference", "train"], default="inference")
    p.add_argument("--quick", action="store_true", help="tokens 1 64 16384 131072, hot 0 1024, rep 25")
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 64, 4096, 16384, 131072])
    p.add_argument("--d-ff", type=int, nargs="*", default=[5632])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--hot-units", type=int, nargs="*", default=[0, 256, 512], help="K dense units, M > 64")
    p.add_argument(
        "--hot-prefix",
        type=int,
        nargs="*",
        default=[],
        help="M > 64: csr with the first P units (ordered by firing on calibration rows) dense",
    )
    p.add_argument(
        "--graph-all",
        action="store_true",
        help="replay every size from a CUDA graph (no host launch cost; "
        "by default only M <= 64), as a captured or compiled model runs its FFNs",
    )
    p.add_argument(
        "--schedules",
        nargs="*",
        choices=[s for s in SCHEDULES if s != "fused"],
        default=["csr", "row"],
        help="M > 64",
    )
    p.add_argument(
        "--decode-splits",
        type=int,
        nargs="*",
        default=[0],
        help="consumer programs per row, M <= 64 (0: the default, kernels.inference.inference.decode_split)",
    )
    p.add_argument(
        "--fused-tiles",
        type=int,
        nargs="*",
        default=[],
        choices=FUSED_TILES,
        help="also time schedule='fused' with these units per program (fused_tile; the default's is shown as 'fused')",
    )
    p.add_argument(
        "--no-fused",
        action="store_true",
        help=f"M <= {FUSED_MAX_TOKENS}: leave out schedule='fused' (the whole FFN in one kernel)",
    )
    p.add_argument(
        "--ordered",
        action="store_true",
        help="M <= 64: units ordered by firing on calibration rows, most first, as "
        "Transformer.order_ffn_units leaves a model (dense and every variant on the permuted weights)",
    )
    p.add_argument(
        "--graph-layers",
        type=int,
        default=8,
        help="M <= 64: also time L layers' FFNs (own weight copies) in one CUDA graph, per layer (1: off)",
    )
    p.add_argument("--activations", help=".pt file with x, w_gate, w_up, w_down (w_down neuron-major [F, D])")
    p.add_argument("--compile", action="store_true", help="inference: also time torch.compile'd dense FFN")
    p.add_argument("--no-compile", action="store_true", help="--mode train: skip the compiled dense baseline")
    p.add_argument("--rep", type=int, default=100, help="ms of timing per measurement")
    p.add_argument("--profile", action="store_true", help="per-kernel GPU times of one call of each variant")
    p.add_argument("--out", default="bench_ffn.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_ffn.py needs a CUDA GPU")
    if args.mode == "train":
        try:
            from bench_train import run_train_bench
        except ImportError as e:
            sys.exit(f"--mode train needs scripts/bench_train.py (run_train_bench), not available: {e}")
        rows = run_train_bench(args)
    else:
        if args.quick:
            args.tokens, args.d_ff, args.rep = [1, 64, 16384, 131072], [5632], 25
            args.hot_units = [0, 1024]
        compiled = torch.compile(dense_ffn) if args.compile else None
        rows, profiles = [], []
        if args.activations:
            # The dump's loader (and its checks: keys, layouts, shapes, each error naming the fix).
            try:
                inputs = load_activations(args.activations, dtype=torch.bfloat16, device="cuda")
            except BadActivations as err:
                sys.exit(f"error: {err}")
            rows += bench_one(inputs, args, compiled, profiles)
            print_table(rows)
        else:
            for F in args.d_ff:
                for M in args.tokens:
                    decode = M <= DECODE_MAX_TOKENS
                    cal = (
                        CALIBRATION_ROWS
                        if (any(args.hot_prefix) and not decode) or (args.ordered and decode)
                        else 0
                    )
                    inputs, calibration = synthetic_inputs(M, args.d_model, F, cal)
                    new = bench_one(inputs, args, compiled, profiles, calibration)
                    print_table(new)
                    rows += new
                    del inputs
                    torch.cuda.empty_cache()
    write_results(args.out, rows, profiles=profiles if args.mode == "inference" and args.profile else None)


if __name__ == "__main__":
    main()
