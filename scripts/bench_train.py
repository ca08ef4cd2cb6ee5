"""Benchmark of the FFN training step: forward + backward including the L1 term, dense vs TwELL.

    python scripts/bench_train.py                      # tokens 16384 65536 x d_ff 5632 8192, d_model 2048
    python scripts/bench_train.py --quick              # 16384 tokens, d_ff 5632 only
    python scripts/bench_train.py --activations acts.layer05.pt --no-compile   # a real model's FFN inputs
    python scripts/bench_train.py --activations acts.layer05.pt --tokens 16384 # its first 16384 rows
    python scripts/bench_ffn.py --mode train           # the same, through the FFN benchmark

Per shape (paper-like bf16 inputs from kernels/synthetic.py): dense PyTorch eager and torch.compile
against twell_ffn with each weight-gradient variant. With --activations, one shape instead: the x
and weights of a real model's layer as `scripts/activity.py --dump-ffn-inputs PATH` saves them (x
[tokens, d_model]; w_gate, w_up, w_down [d_ff, d_model], w_down neuron-major as twell_ffn takes it),
cast to bf16; d_model and d_ff are the dump's, and every row is used unless --tokens N keeps the
first N. Rows and JSON name their `source` (the dump's path, or "synthetic").
Columns: forward ms, forward+backward ms, speed-up over dense eager and compiled, bytes saved for
backward beyond the inputs (measured with saved_tensors_hooks), peak memory of the step, relative
errors of y and the four gradients against an fp32 reference next to the dense-bf16 errors (the
rounding level), rows on the overflow path.
`--profile` adds a per-kernel CUDA time table of one TwELL step (where the time goes).
Every row also reports the host's cost of a step (ms to issue the forward and the backward from a
synchronized start, against the GPU finishing) and the GPU kernels (launches) one step runs. `--sizes
deferred` times TwELL as the trainer runs it (entry lists at fixed sizes, one settle per step);
`--twell-compile` adds TwELL rows under torch.compile (named *_compiled).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import triton
from benchlib import (
    SETTLE,
    BadActivations,
    dense_ffn_l1,
    graphed_step,
    kernel_times,
    load_activations,
    mark_ok,
    prepare_step,
    print_kernel_times,
    settle_step,
    within_tolerance,
    write_results,
)
from benchlib import l1_grad as _l1_grad
from benchlib import step_errors as _errors
from benchlib import train_step as _step
from benchlib import twell_y_l1 as _twell_y_l1

from twell.kernels.synthetic import paper_like_ffn_inputs
from twell.kernels.training.train import (
    BACKWARD_VARIANTS,
    SIZES,
    deferred_sizes,
    set_backward_variant,
    set_hot_units,
    set_sizes,
    set_streams,
    twell_ffn,
)
from twell.kernels.training.train_graph import graph_stats, graphs_enabled, set_graphs

TRAIN_TOKENS = (16384, 65536)
SYNTHETIC = "synthetic"  # the `source` of rows on kernels/synthetic.py inputs


def launches_per_step(fn, leaves, grad_y) -> int:
    """GPU kernels (memsets and copies included) that one step runs, from the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    _step(fn, leaves, grad_y)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(fn, leaves, grad_y)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_times(fn, leaves, grad_y, reps: int = 5) -> dict:
    """Median ms, from a synchronized start: the host returning from the forward (it includes the
    TwELL forward's one read of its counts), from the backward call (no sync inside: pure issue time),
    and the GPU finishing. Backward issue time close to the GPU finish means the step is host-bound."""
    import time

    runs = []
    for _ in range(reps + 1):
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y, l1 = fn(*leaves)
        t1 = time.perf_counter()
        torch.autograd.backward([y, l1], [grad_y, _l1_grad(y.device)])
        t2 = time.perf_counter()
        settle_step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        runs.append((1e3 * (t1 - t0), 1e3 * (t2 - t0), 1e3 * (t3 - t0)))
        del y, l1  # a kept output would make the next forward find its graph's memory in use (eager)
    runs = sorted(runs[1:], key=lambda r: r[2])
    fwd, bwd, done = runs[len(runs) // 2]
    return {"host_fwd_ms": fwd, "host_bwd_issued_ms": bwd, "gpu_done_ms": done}


def _saved_bytes(fn, leaves) -> int:
    """Bytes autograd keeps for backward beyond the inputs (x and weights are saved by any FFN)."""
    seen, total = {t.data_ptr() for t in leaves}, 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return total


def _profile(leaves, grad_y, variant: str, hot: int = 0) -> list[dict]:
    """GPU kernels of one TwELL step in launch order with their times: where the time goes."""
    set_backward_variant(variant)
    kernels, wall = kernel_times(lambda: _step(_twell_y_l1, leaves, grad_y))
    # the dozens of tiny glue kernels are summed in the total
    print_kernel_times(f"TwELL step, backward variant {variant}, hot units {hot}", kernels, wall, min_us=5)
    host = host_times(_twell_y_l1, leaves, grad_y)
    dense = host_times(dense_ffn_l1, leaves, grad_y)
    print(
        "  host (ms from a synchronized start): forward returned {host_fwd_ms:.3f}, backward issued "
        "{host_bwd_issued_ms:.3f}, GPU done {gpu_done_ms:.3f}".format(**host)
        + " | dense: {host_fwd_ms:.3f} / {host_bwd_issued_ms:.3f} / {gpu_done_ms:.3f}".format(**dense)
    )
    _print_host_profile(leaves, grad_y)
    return [{"variant": variant, "hot_units": hot, "wall_ms": wall, **host, **k} for k in kernels]


def _print_host_profile(leaves, grad_y, steps: int = 20, top: int = 30) -> None:
    """Where the host's time goes in a TwELL step (cProfile over `steps` steps, by own time): the
    step is host-bound at 16k, so this names the Python and launch costs worth cutting."""
    import cProfile
    import pstats

    _step(_twell_y_l1, leaves, grad_y)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        _step(_twell_y_l1, leaves, grad_y)
    prof.disable()
    torch.cuda.synchronize()
    print(f"  host profile of {steps} steps (own time; cumulative in the second table):")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


_COMPILED_TWELL: list = []


def _compiled_twell():
    """twell_ffn's (y, l1) under torch.compile (the custom op in an Inductor graph), made once."""
    if not _COMPILED_TWELL:
        _COMPILED_TWELL.append(torch.compile(_twell_y_l1, fullgraph=True))
    return _COMPILED_TWELL[0]


def _bench_impl(name, fn, variant, leaves, grad_y, ref, args, source, rep) -> dict:
    """One implementation's row: times, host cost, launches, memory, errors (and its CUDA graph)."""
    M, D = leaves[0].shape
    F = leaves[1].shape[0]
    errors = _errors(fn, leaves, grad_y, ref)  # also warms up (compile, autotune)
    fwd_ms = triton.testing.do_bench(lambda fn=fn: fn(*leaves), rep=rep, return_mode="median")
    step_ms = triton.testing.do_bench(lambda fn=fn: _step(fn, leaves, grad_y), rep=rep, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(fn, leaves, grad_y)
    torch.cuda.synchronize()
    row = dict(
        source=source, tokens=M, d_model=D, d_ff=F, impl=name, fwd_ms=fwd_ms, fwd_bwd_ms=step_ms,
        # Saved bytes of the compiled dense path are those of its eager twin (hooks cannot see into
        # a compiled graph's saved tensors).
        saved_mb=_saved_bytes(dense_ffn_l1 if name == "dense_compiled" else fn, leaves) / 2**20,
        peak_step_mb=(torch.cuda.max_memory_allocated() - base) / 2**20, **errors,
    )  # fmt: skip
    if (
        getattr(args, "cuda_graph", False) and SETTLE[0] is None
    ):  # (the settle would sync a capture)  # the compiled dense step too: Inductor's kernels capture
        row.update(graphed_step(fn, leaves, grad_y, ref, rep, twell=bool(variant)))
    if variant:
        out = twell_ffn(*leaves)
        row.update(
            overflow_rows=int(out.overflow_rows),
            mean_active=out.row_active.float().mean().item(),
            max_active=int(out.row_active.max()),
        )
        del out  # (as in host_times)
    row.update(host_times(fn, leaves, grad_y), launches=launches_per_step(fn, leaves, grad_y))
    return row


def bench_shape(M: int, F: int, args, compiled, profile: bool = False) -> list[dict]:
    """One synthetic shape: paper-like bf16 inputs [M, d_model] x [F, d_model]."""
    inputs = paper_like_ffn_inputs(M, args.d_model, F, device="cuda", dtype=torch.bfloat16, seed=M + F)
    return bench_inputs(inputs, args, compiled, source=SYNTHETIC, profile=profile)


def bench_inputs(inputs, args, compiled, source: str, profile: bool = False) -> list[dict]:
    """Time and check every implementation on x, w_gate, w_up, w_down (CUDA tensors, one dtype)."""
    leaves, grad_y, ref = prepare_step(inputs)
    rep = getattr(args, "rep", 100)

    impls = [("dense_eager", dense_ffn_l1, None, None)]
    if compiled is not None:
        impls.append(("dense_compiled", compiled, None, None))
    hots = getattr(args, "hot_units", None) or [0]
    variants = getattr(args, "variants", None) or BACKWARD_VARIANTS
    sizes = getattr(args, "sizes", None) or ["estimate"]
    streams = getattr(args, "streams", None) or ["auto"]
    modes = ["eager"] + (["compiled"] if getattr(args, "twell_compile", False) else [])
    op_graphs = getattr(args, "op_graphs", None) or ["off"]  # the library's default (bench_ffn's rows)
    impls += [
        (
            f"twell_{v}"
            + (f"_h{k}" if k else "")
            + ("" if z == "estimate" else f"_{z}")
            + {"auto": "", "on": "_two_streams", "off": "_one_stream"}[st]
            + ("_op_graphs" if g == "on" else "")
            + ("" if c == "eager" else "_compiled"),
            _twell_y_l1 if c == "eager" else _compiled_twell(),
            v,
            k,
            z,
            st,
            g,
        )
        for v in variants
        for k in hots
        for z in sizes
        for st in streams
        for g in op_graphs
        for c in modes
    ]

    rows = []
    for name, fn, variant, hot, *modes in impls:
        with contextlib.ExitStack() as row_scope:
            if variant:
                size_mode, stream_mode, graph_mode = modes
                row_scope.callback(set_graphs, graphs_enabled())
                set_graphs(graph_mode == "on")
                set_backward_variant(variant)
                set_hot_units(hot)
                set_sizes("estimate" if size_mode == "deferred" else size_mode)
                set_streams({"auto": "auto", "on": True, "off": False}[stream_mode])
                if size_mode == "deferred":
                    SETTLE[0] = row_scope.enter_context(deferred_sizes())
                    row_scope.callback(SETTLE.__setitem__, 0, None)
            rows.append(_bench_impl(name, fn, variant, leaves, grad_y, ref, args, source, rep))

    set_backward_variant("auto")
    set_hot_units(None)
    set_sizes("estimate")
    set_streams("auto")

    dense = rows[0]
    best_dense = min(r["fwd_bwd_ms"] for r in rows if r["impl"].startswith("dense"))
    for r in rows:
        r["speedup_vs_eager"] = dense["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        r["speedup_vs_best_dense"] = best_dense / r["fwd_bwd_ms"]
        r["saved_vs_dense"] = r["saved_mb"] / dense["saved_mb"]
    mark_ok(rows)
    if "graph_fwd_bwd_ms" in dense:  # graphed rows: against the graphed dense step, errors as above
        comp = next((r for r in rows if r["impl"] == "dense_compiled" and "graph_fwd_bwd_ms" in r), None)
        for r in rows:
            if "graph_fwd_bwd_ms" in r:
                r["graph_speedup"] = dense["graph_fwd_bwd_ms"] / r["graph_fwd_bwd_ms"]
                if comp is not None:  # against torch.compile'd dense, graphed the same way
                    r["graph_speedup_vs_compiled"] = comp["graph_fwd_bwd_ms"] / r["graph_fwd_bwd_ms"]
                errs = [k for k in r if k.startswith("graph_err_")]
                r["graph_ok"] = r.get("graph_misses", 0) == 0 and all(
                    within_tolerance(r[k], dense[k.replace("graph_", "")]) for k in errs
                )
    if profile:
        for variant in variants:
            for hot in hots:
                set_hot_units(hot)
                args.profiles = getattr(args, "profiles", []) + _profile(leaves, grad_y, variant, hot)
        set_backward_variant("auto")
        set_hot_units(None)
    return rows


def print_table(rows) -> None:
    for source in dict.fromkeys(r.get("source", SYNTHETIC) for r in rows):
        print(f"source: {source}")
    head = (
        f"{'tokens':>7} {'d_ff':>5} {'impl':<20} {'fwd ms':>7} {'f+b ms':>7} {'xEager':>6} {'xBest':>6} "
        f"{'saved MB':>9} {'%dense':>6} {'peak MB':>8} {'err y':>8} {'err dx':>8} {'err dWg':>8} "
        f"{'err dWu':>8} {'err dWd':>8} {'ovf':>4} {'act':>5} ok"
    )
    print(head)
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['d_ff']:>5} {r['impl']:<20} {r['fwd_ms']:>7.3f} {r['fwd_bwd_ms']:>7.3f} "
            f"{r['speedup_vs_eager']:>6.2f} {r['speedup_vs_best_dense']:>6.2f} {r['saved_mb']:>9.1f} "
            f"{100 * r['saved_vs_dense']:>5.1f}% {r['peak_step_mb']:>8.0f} {r['err_y']:>8.1e} {r['err_dx']:>8.1e} "
            f"{r['err_dw_gate']:>8.1e} {r['err_dw_up']:>8.1e} {r['err_dw_down']:>8.1e} "
            f"{r.get('overflow_rows', ''):>4} {r.get('mean_active', 0):>5.1f} {'yes' if r['ok'] else 'NO'}"
        )
    print("host cost of a step (ms from a synchronized start) and GPU kernels per step")
    print(
        f"{'tokens':>7} {'d_ff':>5} {'impl':<28} {'fwd issued':>10} {'bwd issued':>10} {'GPU done':>9} {'kernels':>7}"
    )
    for r in rows:
        if "gpu_done_ms" in r:
            print(
                f"{r['tokens']:>7} {r['d_ff']:>5} {r['impl']:<28} {r['host_fwd_ms']:>10.3f} "
                f"{r['host_bwd_issued_ms']:>10.3f} {r['gpu_done_ms']:>9.3f} {r['launches']:>7}"
            )
    graphed = [r for r in rows if "graph_speedup" in r]
    if graphed:
        print(
            "one CUDA graph per step (replay; errors of the replayed step; misses: static capacity failures)"
        )
        print(
            f"{'tokens':>7} {'d_ff':>5} {'impl':<24} {'graph ms':>8} {'xDense':>6} {'xComp':>6} {'max err':>8} "
            f"{'misses':>6} ok"
        )
        for r in graphed:
            err = max(v for k, v in r.items() if k.startswith("graph_err_"))
            vs_comp = r.get("graph_speedup_vs_compiled")
            print(
                f"{r['tokens']:>7} {r['d_ff']:>5} {r['impl']:<24} {r['graph_fwd_bwd_ms']:>8.3f} "
                f"{r['graph_speedup']:>6.2f} {(f'{vs_comp:6.2f}' if vs_comp else '-'):>6} {err:>8.1e} "
                f"{r['graph_misses']:>6} {'yes' if r['graph_ok'] else 'NO'}"
            )


def run_train_bench(args) -> list[dict]:
    """Bench every (tokens, d_ff); `args` from this script's parser or from scripts/bench_ffn.py.

    From bench_ffn.py only token counts in [1024, 65536] are used (its list holds decode sizes), and
    the defaults are taken when none is left.
    With `args.activations` (a dump path) the one shape of that dump is benched instead (d_ff, d_model,
    --tokens and --quick do not apply): args.activation_inputs if main() loaded it already, else the
    file, all of its rows (bench_ffn.py --mode train --activations) or the first args.activation_rows.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_train needs a CUDA GPU")
    compiled = None if getattr(args, "no_compile", False) else torch.compile(dense_ffn_l1)
    path = getattr(args, "activations", None)
    if path:
        cpu = getattr(args, "activation_inputs", None) or load_activations(
            path, tokens=getattr(args, "activation_rows", None)
        )
        inputs = [t.to("cuda") for t in cpu]
        rows = bench_inputs(inputs, args, compiled, source=path, profile=getattr(args, "profile", False))
        print_table(rows)
        return rows
    tokens = [t for t in getattr(args, "tokens", None) or TRAIN_TOKENS if 1024 <= t <= 65536]
    tokens = tokens or list(TRAIN_TOKENS)
    if getattr(args, "quick", False):
        tokens, args.d_ff = [16384], [5632]
    rows = []
    for F in args.d_ff:
        for M in tokens:
            first = (M, F) == (min(tokens), args.d_ff[0])
            new = bench_shape(M, F, args, compiled, profile=getattr(args, "profile", False) and first)
            print_table(new)
            rows += new
            torch.cuda.empty_cache()
            if getattr(args, "write_each_shape", False):  # a run cut short still leaves its numbers
                _write_json(args.out, rows, args)
    return rows


def _write_json(path: str, rows: list[dict], args) -> None:
    source = getattr(args, "activations", None) or SYNTHETIC
    write_results(path, rows, quiet=True, source=source, profiles=getattr(args, "profiles", []))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tokens",
        type=int,
        nargs="*",
        default=None,
        help=f"token counts (default {' '.join(map(str, TRAIN_TOKENS))}); with --activations one N: "
        "bench the dump's first N rows (default: every row)",
    )
    p.add_argument("--d-ff", type=int, nargs="*", default=[5632, 8192], help="ignored with --activations")
    p.add_argument("--d-model", type=int, default=2048, help="ignored with --activations")
    p.add_argument(
        "--activations",
        metavar="PATH",
        help="bench a real model's FFN inputs instead of synthetic ones: a .pt from scripts/activity.py "
        "--dump-ffn-inputs (x [tokens, d_model]; w_gate, w_up, w_down [d_ff, d_model], w_down "
        "neuron-major); d_model and d_ff are the dump's (--d-ff, --d-model and --quick are ignored)",
    )
    p.add_argument("--variants", nargs="*", choices=BACKWARD_VARIANTS, default=list(BACKWARD_VARIANTS))
    p.add_argument(
        "--hot-units", type=int, nargs="*", default=[0, 1024], help="K units on dense GEMMs (0: all sparse)"
    )
    p.add_argument(
        "--sizes", nargs="*", choices=(*SIZES, "deferred"), default=["estimate"],
        help="how the op sizes its entry list: estimate (default, no sync while the gate runs), exact, "
        "static, late (the forward never waits; the backward checks), or deferred (fixed sizes settled once "
        "per step, as the trainer runs it)",
    )  # fmt: skip
    p.add_argument(
        "--twell-compile", action="store_true", help="also time TwELL under torch.compile (rows *_compiled)"
    )
    p.add_argument(
        "--cuda-graph", action="store_true",
        help="also time each step captured in one CUDA graph (dense eager and compiled, TwELL at static sizes)",
    )  # fmt: skip
    p.add_argument(
        "--streams", nargs="*", choices=("auto", "on", "off"), default=["auto"],
        help="the hot units' GEMMs on a second CUDA stream only inside a CUDA graph capture (auto, the "
        "default), always (on: rows named *_two_streams) or never (off: *_one_stream); several to compare",
    )  # fmt: skip
    p.add_argument(
        "--op-graphs", nargs="*", choices=("on", "off"), default=["off"],
        help="TwELL's forward and backward replayed from per-layer CUDA graphs (on: rows named *_op_graphs; "
        "kernels/training/train_graph.py) or issued eagerly (off, the library's default); both to compare",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="16384 tokens, d_ff 5632 only (synthetic)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile dense baseline")
    p.add_argument("--profile", action="store_true", help="per-kernel CUDA times of one TwELL step")
    p.add_argument("--rep", type=int, default=100, help="ms of timing per measurement")
    p.add_argument("--out", default="bench_train.json")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.activations:  # checked before the GPU, so a bad file is reported on any machine
        if args.tokens and len(args.tokens) > 1:
            sys.exit(
                f"error: with --activations, --tokens takes one N (the dump's first N rows), got {args.tokens}"
            )
        args.activation_rows = args.tokens[0] if args.tokens else None
        try:
            args.activation_inputs = load_activations(args.activations, tokens=args.activation_rows)
        except BadActivations as err:
            sys.exit(f"error: {err}")
        x, w_gate = args.activation_inputs[:2]
        print(f"{args.activations}: {x.shape[0]} tokens, d_model {x.shape[1]}, d_ff {w_gate.shape[0]}")
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU")
    args.write_each_shape = True
    rows = run_train_bench(args)
    print(f"TwELL forwards replayed from per-layer CUDA graphs: {graph_stats()}")
    print("\nall shapes:")
    print_table(rows)
    _write_json(args.out, rows, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
