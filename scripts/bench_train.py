"""Benchmark of the FFN training step: forward + backward including the L1 term, dense vs TwELL.

    python scripts/bench_train.py                      # tokens 16384 65536 x d_ff 5632 8192, d_model 2048
    python scripts/bench_train.py --quick              # 16384 tokens, d_ff 5632 only
    python scripts/bench_ffn.py --mode train           # the same, through the FFN benchmark

Per shape (paper-like bf16 inputs from kernels/synthetic.py): dense PyTorch eager and torch.compile
against twell_ffn with each weight-gradient variant. Columns: forward ms, forward+backward ms,
speed-up over dense eager and compiled, bytes saved for backward beyond the inputs (measured with
saved_tensors_hooks), peak memory of the step, relative errors of y and the four gradients against an
fp32 reference next to the dense-bf16 errors (the rounding level), rows on the overflow path.
`--profile` adds a per-kernel CUDA time table of one TwELL step (where the time goes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.synthetic import paper_like_ffn_inputs  # noqa: E402
from kernels.train import BACKWARD_VARIANTS, set_backward_variant, twell_ffn  # noqa: E402

L1_COEF = 2e-5  # the paper's coefficient
TRAIN_TOKENS = (16384, 65536)


def dense_ffn_l1(x, w_gate, w_up, w_down):
    """What a dense model layer runs: the FFN and its L1 term (mean over tokens of sum |h|).

    The fp32 sum without an fp32 copy of h: abs() saves the h the down matmul saves anyway."""
    h = torch.relu(x @ w_gate.T) * (x @ w_up.T)
    return h @ w_down, h.abs().sum(dim=-1, dtype=torch.float32).mean()


def _twell_y_l1(x, w_gate, w_up, w_down):
    out = twell_ffn(x, w_gate, w_up, w_down)
    return out.y, out.l1


def _step(fn, leaves, grad_y):
    for t in leaves:
        t.grad = None
    y, l1 = fn(*leaves)
    torch.autograd.backward([y, l1], [grad_y, torch.tensor(L1_COEF, device=y.device)])


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


def _rel(a, b) -> float:
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _errors(fn, leaves, grad_y, ref) -> dict:
    _step(fn, leaves, grad_y)
    with torch.no_grad():
        y, _ = fn(*leaves)
    names = ("dx", "dw_gate", "dw_up", "dw_down")
    out = {"err_y": _rel(y, ref["y"])}
    out.update({f"err_{n}": _rel(t.grad, ref[n]) for n, t in zip(names, leaves)})
    return out


def _reference(inputs, grad_y) -> dict:
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    torch.backends.cuda.matmul.allow_tf32 = False
    _step(dense_ffn_l1, leaves, grad_y.float())
    with torch.no_grad():
        y, _ = dense_ffn_l1(*leaves)
    ref = {"y": y}
    ref.update({n: t.grad for n, t in zip(("dx", "dw_gate", "dw_up", "dw_down"), leaves)})
    return ref


def _profile(leaves, grad_y, variant: str) -> list[dict]:
    """GPU kernels of one TwELL step in launch order with their times: where the time goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    set_backward_variant(variant)
    _step(_twell_y_l1, leaves, grad_y)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(_twell_y_l1, leaves, grad_y)
        torch.cuda.synchronize()
    kernels = [
        {"kernel": e.name, "us": e.time_range.elapsed_us(), "start": e.time_range.start}
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
    kernels.sort(key=lambda k: k["start"])
    total = sum(k["us"] for k in kernels)
    print(
        f"\nTwELL step, backward variant {variant}: {len(kernels)} kernels, {total / 1e3:.3f} ms of GPU time"
    )
    for k in kernels:
        if k["us"] >= 5:  # the dozens of tiny glue kernels are summed in the total
            print(f"  {k['us']:8.1f} us  {k['kernel'][:90]}")
    return [{"variant": variant, "kernel": k["kernel"], "us": k["us"]} for k in kernels]


def bench_shape(M: int, F: int, args, compiled) -> list[dict]:
    import triton

    D = args.d_model
    inputs = paper_like_ffn_inputs(M, D, F, device="cuda", dtype=torch.bfloat16, seed=M + F)
    grad_y = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    ref = _reference(inputs, grad_y)
    leaves = [t.clone().requires_grad_() for t in inputs]
    rep = getattr(args, "rep", 100)

    impls = [("dense_eager", dense_ffn_l1, None)]
    if compiled is not None:
        impls.append(("dense_compiled", compiled, None))
    impls += [(f"twell_{v}", _twell_y_l1, v) for v in getattr(args, "variants", None) or BACKWARD_VARIANTS]

    rows = []
    for name, fn, variant in impls:
        if variant:
            set_backward_variant(variant)
        errors = _errors(fn, leaves, grad_y, ref)  # also warms up (compile, autotune)
        fwd_ms = triton.testing.do_bench(lambda fn=fn: fn(*leaves), rep=rep, return_mode="median")
        step_ms = triton.testing.do_bench(
            lambda fn=fn: _step(fn, leaves, grad_y), rep=rep, return_mode="median"
        )
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(fn, leaves, grad_y)
        torch.cuda.synchronize()
        row = dict(
            tokens=M, d_model=D, d_ff=F, impl=name, fwd_ms=fwd_ms, fwd_bwd_ms=step_ms,
            # Saved bytes of the compiled dense path are those of its eager twin (hooks cannot see into
            # a compiled graph's saved tensors).
            saved_mb=_saved_bytes(dense_ffn_l1 if name == "dense_compiled" else fn, leaves) / 2**20,
            peak_step_mb=(torch.cuda.max_memory_allocated() - base) / 2**20, **errors,
        )  # fmt: skip
        if variant:
            out = twell_ffn(*leaves)
            row.update(
                overflow_rows=int(out.overflow_rows),
                mean_active=out.row_active.float().mean().item(),
                max_active=int(out.row_active.max()),
            )
        rows.append(row)
    set_backward_variant("auto")

    dense = rows[0]
    best_dense = min(r["fwd_bwd_ms"] for r in rows if r["impl"].startswith("dense"))
    for r in rows:
        r["speedup_vs_eager"] = dense["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        r["speedup_vs_best_dense"] = best_dense / r["fwd_bwd_ms"]
        r["saved_vs_dense"] = r["saved_mb"] / dense["saved_mb"]
        # Correct = within 3x the dense-bf16 error (the rounding level) or 1e-2, for y and every gradient.
        errs = [k for k in r if k.startswith("err_")]
        r["ok"] = all(r[k] <= max(3 * dense[k], 1e-2) for k in errs)
    if getattr(args, "profile", False) and (M, F) == (min(args.tokens_used), args.d_ff[0]):
        for variant in getattr(args, "variants", None) or BACKWARD_VARIANTS:
            args.profiles = getattr(args, "profiles", []) + _profile(leaves, grad_y, variant)
        set_backward_variant("auto")
    return rows


def print_table(rows) -> None:
    head = (
        f"{'tokens':>7} {'d_ff':>5} {'impl':<15} {'fwd ms':>7} {'f+b ms':>7} {'xEager':>6} {'xBest':>6} "
        f"{'saved MB':>9} {'%dense':>6} {'peak MB':>8} {'err y':>8} {'err dx':>8} {'err dWg':>8} "
        f"{'err dWu':>8} {'err dWd':>8} {'ovf':>4} {'act':>5} ok"
    )
    print(head)
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['d_ff']:>5} {r['impl']:<15} {r['fwd_ms']:>7.3f} {r['fwd_bwd_ms']:>7.3f} "
            f"{r['speedup_vs_eager']:>6.2f} {r['speedup_vs_best_dense']:>6.2f} {r['saved_mb']:>9.1f} "
            f"{100 * r['saved_vs_dense']:>5.1f}% {r['peak_step_mb']:>8.0f} {r['err_y']:>8.1e} {r['err_dx']:>8.1e} "
            f"{r['err_dw_gate']:>8.1e} {r['err_dw_up']:>8.1e} {r['err_dw_down']:>8.1e} "
            f"{r.get('overflow_rows', ''):>4} {r.get('mean_active', 0):>5.1f} {'yes' if r['ok'] else 'NO'}"
        )


def run_train_bench(args) -> list[dict]:
    """Bench every (tokens, d_ff); `args` from this script's parser or from scripts/bench_ffn.py.

    From bench_ffn.py only token counts in [1024, 65536] are used (its list holds decode sizes), and
    the defaults are taken when none is left.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_train needs a CUDA GPU")
    tokens = [t for t in getattr(args, "tokens", TRAIN_TOKENS) if 1024 <= t <= 65536] or list(TRAIN_TOKENS)
    if getattr(args, "quick", False):
        tokens, args.d_ff = [16384], [5632]
    args.tokens_used = tokens
    compiled = None if getattr(args, "no_compile", False) else torch.compile(dense_ffn_l1)
    rows = []
    for F in args.d_ff:
        for M in tokens:
            new = bench_shape(M, F, args, compiled)
            print_table(new)
            rows += new
            torch.cuda.empty_cache()
            if getattr(args, "write_each_shape", False):  # a run cut short still leaves its numbers
                _write_json(args.out, rows, args)
    return rows


def _write_json(path: str, rows: list[dict], args) -> None:
    blob = {"device": torch.cuda.get_device_name(), "rows": rows, "profiles": getattr(args, "profiles", [])}
    with open(path, "w") as f:
        json.dump(blob, f, indent=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=list(TRAIN_TOKENS))
    p.add_argument("--d-ff", type=int, nargs="*", default=[5632, 8192])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--variants", nargs="*", choices=BACKWARD_VARIANTS, default=list(BACKWARD_VARIANTS))
    p.add_argument("--quick", action="store_true", help="16384 tokens, d_ff 5632 only")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile dense baseline")
    p.add_argument("--profile", action="store_true", help="per-kernel CUDA times of one TwELL step")
    p.add_argument("--rep", type=int, default=100, help="ms of timing per measurement")
    p.add_argument("--out", default="bench_train.json")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU")
    args.write_each_shape = True
    rows = run_train_bench(args)
    print("\nall shapes:")
    print_table(rows)
    _write_json(args.out, rows, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
