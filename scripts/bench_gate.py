"""Gate GEMM micro-benchmark: where does twell_gate's time go (mainloop or compaction epilogue)?

    python scripts/bench_gate.py --out bench_gate.json
    python scripts/bench_gate.py --quick --out bench_gate.json   # no counts / fused s128, hot 512 only, rep 25

Per token count, times cuBLAS (x @ w_gate.T, and with relu) against our gate kernel per variant:
epilogue (counts: mainloop + a per-row count only; dense: relu stored dense like a plain GEMM; twell sN:
the fused compaction in N-column mainloop + scan steps per format tile; two_kernel: dense relu pass +
the compaction kernel: "bits" = the dense_bits epilogue (relu + positive bitmask) and the set-bit
compaction, the GPU default; "scan" = the round-4 full-width scan), plus each compaction kernel alone on
a ready relu buffer (with the GB/s of h a full read would be) and the hot-split gate (two_kernel + top-K
+ hot columns to a dense [M, K] buffer) with either compaction. TF/s counts 2 M D F. Variants that lost in round 3 (twell_old, s256, s64,
persistent, n128) are gone; git history has them. Default shapes 131072 and 16384 (< 1 min on an H200).
"""

from __future__ import annotations

import argparse
import sys

import torch
from benchlib import median_ms, synthetic_inputs, write_results

from twell.kernels.gate import default_slots, default_tile_n, launch_gate, set_gate_variant, twell_gate_hot
from twell.kernels.gate_compact import (
    _tuned_compact,
    _tuned_compact_bits,
    launch_compact,
    launch_compact_bits,
)
from twell.kernels.gate_gemm import (
    _TUNED,
    PERSISTENT_CONFIGS,
    _launch_gemm,
    _regime,
    launch_relu_bits_persistent,
)

VARIANTS = [  # (loads, epilogue, sub_n, path, format tile_n or None for the default, compact)
    ("tma", "counts", None, None, None, None),
    ("tma", "dense", None, None, None, None),
    ("tma", "dense_bits", None, None, None, None),
    ("tma", "twell", 128, "fused", None, None),
    ("tma", "twell", None, "two_kernel", None, "scan"),
    ("tma", "twell", None, "two_kernel", None, "bits"),
]
QUICK_VARIANTS = [v for v in VARIANTS if v[3] != "fused" and v[1] != "counts"]


def bench_shape(M, D, F, rep, variants, hot_units=(256, 512)):
    x, wg, _, _ = synthetic_inputs(M, D, F)[0]
    flop = 2.0 * M * D * F
    out = []

    def row(name, ms, **extra):
        r = dict(tokens=M, d_model=D, d_ff=F, variant=name, ms=ms, tflops=flop / (ms * 1e9), **extra)
        print(
            f"{M:>7} {F:>5} {name:<26} {ms:8.3f} ms {r['tflops']:7.1f} TF/s {extra.get('config', '')}",
            flush=True,
        )
        out.append(r)

    row("cublas x@w.T", median_ms(lambda: x @ wg.T, rep))
    row("cublas relu(x@w.T)", median_ms(lambda: torch.relu(x @ wg.T), rep))
    buffers = {}
    for loads, epi, sub_n, path, tn, compact in variants:
        tile_n = tn or default_tile_n(M, F)
        if M <= 64 and (epi != "twell" or tn):
            continue
        if tile_n not in buffers:
            buffers.clear()
            torch.cuda.empty_cache()
            slots = tile_n if M <= 64 else default_slots(tile_n)
            T = -(-F // tile_n)
            buffers[tile_n] = (
                torch.empty((M, T), dtype=torch.int32, device="cuda"),
                torch.empty((M, T, slots), dtype=torch.int16, device="cuda"),
                torch.empty((M, T, slots), dtype=x.dtype, device="cuda"),
                slots,
            )
        slots = buffers[tile_n][3]
        dense = torch.empty((M, F), dtype=x.dtype, device="cuda") if epi.startswith("dense") else None
        b = buffers[tile_n]
        if epi == "dense_bits":  # the bitmask goes where the counts would: [M, F // 32] int32
            b = (torch.empty((M, F // 32), dtype=torch.int32, device="cuda"),) + b[1:]
        set_gate_variant(loads=loads, sub_n=sub_n, path=path, compact=compact)
        fn = lambda e=epi, d=dense, t=tile_n, b=b: launch_gate(  # noqa: E731
            x, wg, b[0], b[1], b[2], t, b[3], epilogue=e, dense=d
        )
        name = f"{loads} {epi if path != 'two_kernel' else 'two_kernel'}"
        name += f" {compact}" if compact else ""
        name += f" n{tile_n}" + (f" s{min(sub_n, tile_n)}" if epi == "twell" and path == "fused" else "")
        try:
            fn()
            ms = median_ms(fn, rep)
        except Exception as e:  # a variant that does not compile here is a result, not a crash
            print(f"{M:>7} {F:>5} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        finally:
            del dense, b
        best = _TUNED[_regime(M)].best_config
        row(name, ms, config=str(best), sub_n=sub_n, path=path, tile_n=tile_n, slots=slots)
    set_gate_variant()
    if M <= 64:
        return out
    tile_n = default_tile_n(M, F)
    counts, cols, vals, slots = buffers[tile_n]
    h = torch.empty((M, F), dtype=x.dtype, device="cuda")
    bits = torch.empty((M, F // 32), dtype=torch.int32, device="cuda")
    try:
        _launch_gemm(x, wg, bits, cols, vals, tile_n, slots, "dense_bits", h)  # h = relu(x w^T) + bitmask
    except Exception as e:  # keep the scan numbers if the bitmask epilogue does not compile here
        print(f"dense_bits FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        h.copy_(torch.relu(x @ wg.T))
        bits = None
    gbs_full = h.numel() * h.element_size() / 1e6  # MB of h a full read is (the entries are ~0.5% of it)
    runs = {
        "scan": (lambda: launch_compact(h, counts, cols, vals, tile_n, slots), _tuned_compact),
        "bits": (
            lambda: launch_compact_bits(h, bits, counts, cols, vals, tile_n, slots),
            _tuned_compact_bits,
        ),
    }
    for kind, (fn, tuned) in runs.items():
        if kind == "bits" and bits is None:
            continue
        fn()
        ms = median_ms(fn, rep)
        gbs = gbs_full / ms
        row(f"compaction {kind} alone", ms, gbs=gbs, config=f"{gbs:.0f} GB/s(h) {tuned.best_config}")
    runs.clear()
    h = bits = None  # free before the hot gates
    for K in hot_units:
        for compact in ("scan", "bits"):
            set_gate_variant(compact=compact)
            twell_gate_hot(x, wg, K)
            ms = median_ms(lambda K=K: twell_gate_hot(x, wg, K), rep)
            row(f"two_kernel {compact} hot{K}", ms, hot_units=K, compact=compact)
    set_gate_variant()
    return out


# The persistent dense_bits sweep: the library's configs plus a few that may not compile or fit (deeper
# pipelines, 256-row tiles, no flattening); each is checked against the
# tile-per-program kernel's h and bitmask.
SWEEP_CONFIGS = PERSISTENT_CONFIGS + [
    (128, 256, 64, 8, 4, True, True),
    (128, 128, 64, 8, 4, True, True),
    (128, 256, 64, 8, 3, False, True),
    (128, 128, 128, 8, 3, True, True),
    (256, 128, 64, 8, 3, True, True),
    (128, 256, 128, 8, 2, True, True),
]


def bench_bits_gemm(M, D, F, rep) -> list[dict]:
    """The dense_bits GEMM (h = relu(x w^T) + positive bitmask): cuBLAS x @ w^T and relu for scale, the
    tile-per-program kernel (autotuned) and the persistent kernel per config and autotuned."""
    x, wg, _, _ = synthetic_inputs(M, D, F)[0]
    flop = 2.0 * M * D * F
    tile_n = default_tile_n(M, F)
    h_ref = torch.empty((M, F), dtype=x.dtype, device="cuda")
    bits_ref = torch.empty((M, F // 32), dtype=torch.int32, device="cuda")
    h = torch.empty_like(h_ref)
    bits = torch.empty_like(bits_ref)
    out = []

    def row(name, fn, **extra):
        try:
            fn()
            ms = median_ms(fn, rep)
        except Exception as e:  # a config that does not compile or fit here is a result, not a crash
            print(f"{M:>7} {F:>5} {name:<44} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        check = ""
        if "persistent" in name:
            diff = (h.float() - h_ref.float()).abs().max().item()
            flips = int((bits ^ bits_ref).ne(0).sum())
            extra.update(max_abs_diff=diff, words_differing=flips)
            check = f"max|h-h_tiles| {diff:.1e}, bit words differing {flips}"
        r = dict(tokens=M, d_model=D, d_ff=F, variant=name, ms=ms, tflops=flop / (ms * 1e9), **extra)
        print(f"{M:>7} {F:>5} {name:<44} {ms:8.3f} ms {r['tflops']:7.1f} TF/s {check}", flush=True)
        out.append(r)

    row("cublas x@w.T", lambda: x @ wg.T)
    row("cublas relu(x@w.T)", lambda: torch.relu(x @ wg.T))
    row(
        "tiles dense_bits",
        lambda: _launch_gemm(x, wg, bits_ref, bits_ref, h_ref, tile_n, 32, "dense_bits", h_ref),
    )
    for cfg in SWEEP_CONFIGS:
        name = "persistent {}x{}x{} w{} s{}{}{}".format(
            *cfg[:5], " split" if cfg[5] else "", " flat" if cfg[6] else ""
        )
        h.fill_(float("nan"))
        row(name, lambda c=cfg: launch_relu_bits_persistent(x, wg, h, bits, config=c), config=list(cfg))
    h.fill_(float("nan"))
    row("persistent autotuned", lambda: launch_relu_bits_persistent(x, wg, h, bits))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[131072, 16384])
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--rep", type=int, default=40, help="ms of timing per measurement")
    p.add_argument("--quick", action="store_true", help="no counts / fused s128, hot 512 only, rep 25")
    p.add_argument(
        "--bits-gemm", action="store_true", help="only the dense_bits GEMM: tiles vs persistent configs"
    )
    p.add_argument("--out", default="bench_gate.json")
    args = p.parse_args(argv)
    variants, hot_units = VARIANTS, (256, 512)
    if args.quick:
        variants, hot_units, args.rep = QUICK_VARIANTS, (512,), 25
    if not torch.cuda.is_available():
        sys.exit("bench_gate.py needs a CUDA GPU")
    rows = []
    for M in args.tokens:
        if args.bits_gemm:
            rows += bench_bits_gemm(M, args.d_model, args.d_ff, args.rep)
            continue
        rows += bench_shape(M, args.d_model, args.d_ff, args.rep, variants, hot_units)
        torch.cuda.empty_cache()
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
