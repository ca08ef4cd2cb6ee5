"""Benchmark the TwELL FFN against dense PyTorch/cuBLAS (eager and torch.compile) on one GPU.

    python scripts/bench_ffn.py --out bench_ffn.json            # full run (< 6 min on an H200)
    python scripts/bench_ffn.py --quick                          # a short run
    python scripts/bench_ffn.py --activations dump.pt            # x, w_gate, w_up, w_down from a real model
    python scripts/bench_ffn.py --mode train                     # training kernels (scripts/bench_train.py)

The gate is timed per variant (a program per tile / persistent / two-kernel) and the fastest is used for
the FFN; 'sparse' = FFN - gate (row schedule), with TF/s of useful work (4 D per active pair) and the GB/s
the weight rows would need if no two tokens shared one (2 rows of D per active pair).
Every measured configuration is also checked row by row against a float32 reference (max relative
error per row < 1e-2). Small batches run under CUDA graphs (launch overhead would dominate otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import twell_ffn_inference, twell_gate  # noqa: E402
from kernels.gate import set_gate_variant  # noqa: E402
from kernels.inference import DECODE_MAX_TOKENS  # noqa: E402
from kernels.synthetic import paper_like_ffn_inputs  # noqa: E402

GRAPH_MAX_TOKENS = 64


def dense_ffn(x, w_gate, w_up, w_down):
    return (torch.relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down


def timed(fn, use_graph: bool, rep_ms: int) -> float:
    """Median ms of fn() (triton.testing.do_bench), replayed from a CUDA graph for small batches."""
    import triton

    if use_graph:
        fn()  # compile / autotune outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(graph.replay, rep=rep_ms, return_mode="median")
    return triton.testing.do_bench(fn, rep=rep_ms, return_mode="median")


def row_errors(y, x, w_gate, w_up, w_down) -> torch.Tensor:
    ref = dense_ffn(*(t.float() for t in (x, w_gate, w_up, w_down)))
    return (y.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)


def gate_call(x, w_gate):
    """twell_gate as the row schedule calls it (decode: 32-wide tiles, 32 slots)."""
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return twell_gate(x, w_gate, tile_n=32, slots=32)
    return twell_gate(x, w_gate)


def pick_gate_variant(x, w_gate, graph, rep) -> tuple[str, dict]:
    """Time the gate's variants (one program per tile / persistent grid / dense pass + compaction
    kernel) and keep the fastest."""
    times = {}
    options = {"tiles": {}}
    if x.shape[0] > DECODE_MAX_TOKENS:
        options.update(persistent={"persistent": True}, two_kernel={"path": "two_kernel"})
    for name, variant in options.items():
        set_gate_variant(**variant)
        times[name] = timed(lambda: gate_call(x, w_gate), graph, rep)
    best = min(times, key=times.get)
    set_gate_variant(**options[best])
    return best, times


def bench_one(inputs, args, compiled) -> list[dict]:
    x, w_gate, w_up, w_down = inputs
    M, D = x.shape
    F = w_gate.shape[0]
    graph = M <= GRAPH_MAX_TOKENS
    # Rotate copies of x when everything fits in L2, so the dense path cannot run from a warm cache.
    copies = [x] + [x.clone() for _ in range(3)] if M <= 4096 else [x]
    state = {"i": 0}

    def pick():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    if graph:  # graphs capture fixed pointers: rotation would be meaningless there
        pick = lambda: x
    with torch.no_grad():
        pre = x.float() @ w_gate.float().T
        active = (pre > 0).sum(1, dtype=torch.int32)
        mean_active = float(active.float().mean())
        del pre
        pairs = float(active.sum())
        flops_sparse = 4.0 * D * pairs  # up dot + down axpy per active (row, unit)
        bytes_sparse = 2.0 * D * x.element_size() * pairs  # w_up and w_down rows per pair, if not shared
        flops_dense = 6.0 * M * D * F
        dense_ms = timed(lambda: dense_ffn(pick(), w_gate, w_up, w_down), graph, args.rep)
        comp_ms = timed(lambda: compiled(pick(), w_gate, w_up, w_down), graph, args.rep) if compiled else None
        gate_variant, gate_times = pick_gate_variant(x, w_gate, graph, args.rep)
        gate_ms = gate_times[gate_variant]
        variants = [("row", s) for s in (args.decode_splits if M <= DECODE_MAX_TOKENS else [None])]
        variants += [(s, None) for s in args.schedules if s != "row"]
        rows = []
        for schedule, split in variants:
            kw = dict(schedule=schedule, split=split)
            y, stats = twell_ffn_inference(x, w_gate, w_up, w_down, return_stats=True, **kw)
            err = row_errors(y, x, w_gate, w_up, w_down)
            ms = timed(lambda kw=kw: twell_ffn_inference(pick(), w_gate, w_up, w_down, **kw), graph, args.rep)
            sparse_ms = max(ms - gate_ms, 1e-6) if schedule == "row" else None
            rows.append(
                dict(
                    tokens=M,
                    d_model=D,
                    d_ff=F,
                    schedule=schedule if split is None else f"{schedule}/s{split}",
                    cuda_graph=graph,
                    mean_active=mean_active,
                    max_active=int(active.max()),
                    dense_ms=dense_ms,
                    compiled_ms=comp_ms,
                    twell_ms=ms,
                    gate_ms=gate_ms,
                    gate_variant=gate_variant,
                    gate_times=gate_times,
                    sparse_ms=sparse_ms,
                    speedup=dense_ms / ms,
                    speedup_vs_compiled=(comp_ms / ms) if comp_ms else None,
                    sparse_tflops=(flops_sparse / (sparse_ms * 1e9)) if sparse_ms else None,
                    sparse_gbs=(bytes_sparse / (sparse_ms * 1e6)) if sparse_ms else None,
                    useful_tflops_total=flops_sparse / (ms * 1e9),
                    dense_tflops=flops_dense / (dense_ms * 1e9),
                    overflow_rows=int(stats.overflow_rows),
                    max_row_rel_err=float(err.max()),
                    correct=bool(err.max() < 1e-2),
                )
            )
        set_gate_variant()
        return rows


def print_table(rows):
    head = (
        f"{'tokens':>7} {'d_ff':>5} {'sched':>7} {'graph':>5} {'dense':>8} {'compile':>8} {'twell':>8} "
        f"{'x dense':>7} {'gate':>7} {'gvar':>5} {'sparse':>7} {'sp TF/s':>7} {'sp GB/s':>7} {'ovf':>4} {'maxerr':>8} ok"
    )
    print(head)
    for r in rows:
        comp = f"{r['compiled_ms']:8.3f}" if r["compiled_ms"] else f"{'-':>8}"
        sp_ms = f"{r['sparse_ms']:7.3f}" if r["sparse_ms"] else f"{'-':>7}"
        sp = f"{r['sparse_tflops']:7.1f}" if r["sparse_tflops"] else f"{'-':>7}"
        gbs = f"{r['sparse_gbs']:7.0f}" if r["sparse_gbs"] else f"{'-':>7}"
        print(
            f"{r['tokens']:>7} {r['d_ff']:>5} {r['schedule']:>7} {str(r['cuda_graph']):>5} {r['dense_ms']:8.3f} "
            f"{comp} {r['twell_ms']:8.3f} {r['speedup']:7.2f} {r['gate_ms']:7.3f} {r['gate_variant'][:5]:>5} "
            f"{sp_ms} {sp} {gbs} {r['overflow_rows']:>4} {r['max_row_rel_err']:8.2e} {'yes' if r['correct'] else 'NO'}",
            flush=True,
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["inference", "train"], default="inference")
    p.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 16, 64, 4096, 16384, 131072])
    p.add_argument("--d-ff", type=int, nargs="*", default=[5632, 8192])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--schedules", nargs="*", default=["row", "block"])
    p.add_argument(
        "--decode-splits", type=int, nargs="*", default=[8, 4, 1], help="consumer programs per row, M <= 64"
    )
    p.add_argument("--activations", help=".pt file with x, w_gate, w_up, w_down (w_down neuron-major [F, D])")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--rep", type=int, default=100, help="ms of timing per measurement")
    p.add_argument("--out", default="bench_ffn.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_ffn.py needs a CUDA GPU")
    if args.mode == "train":
        try:
            from scripts.bench_train import run_train_bench
        except ImportError as e:
            sys.exit(f"--mode train needs scripts/bench_train.py (run_train_bench), not available: {e}")
        rows = run_train_bench(args)
    else:
        if args.quick:
            args.tokens, args.d_ff, args.rep = [1, 64, 16384], [5632], 40
        compiled = None if args.no_compile else torch.compile(dense_ffn)
        rows = []
        if args.activations:
            blob = torch.load(args.activations, map_location="cuda")
            inputs = [blob[k].to(torch.bfloat16).contiguous() for k in ("x", "w_gate", "w_up", "w_down")]
            rows += bench_one(inputs, args, compiled)
            print_table(rows)
        else:
            for F in args.d_ff:
                for M in args.tokens:
                    inputs = paper_like_ffn_inputs(M, args.d_model, F, device="cuda", seed=M + F)
                    new = bench_one(inputs, args, compiled)
                    print_table(new)
                    rows += new
                    del inputs
                    torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
