"""The training op's host time split by function, forward and backward (issue 31), on the device:

    python docs/results/2026-12-05-f/host_split2.py out.json

Session (e)'s host_split.py timed the forward's parts; this times the backward's too, and the gate GEMM's
launch (0.26 ms of the forward) by its steps. Same method: every timed call is issued while the GPU runs a
long sleep kernel queued before it (sizes deferred, nothing read back), so what is timed is the host's
issue time alone; each part is a timing wrapper around a function the op calls (~0.3 us each; nested parts
are inside their parents; the upstream gradients of y and l1 are made before the backward is timed, where session
(e) timed them with it). Then the number of PyTorch operators and Triton launches each direction issues
(counted in a separate pass: the counting itself costs time). 16,384 x 2048 x 5632 bf16, paper-like inputs,
1,024 hot units, median of 15 calls, the default settings (kept kernels, one stream).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.tools.tensor_descriptor import TensorDescriptor

import twell.kernels._launch as L
import twell.kernels.gate as G
import twell.kernels.training.train as T
from twell.kernels.synthetic import paper_like_ffn_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-05-e"))
from host_split import busy, spent, timed  # noqa: E402  (session (e)'s sleep kernel and timing wrapper)

# (module, function) pairs wrapped; the forward's as in session (e), then the gate's steps and the backward's.
PARTS = [
    (T, "relu_gate_bits"), (T, "count_fires"), (T, "hot_split"), (T, "build_pattern"), (T, "row_ffn_forward"),
    (T, "hot_forward"), (T, "_setup_context"),
    (G, "check_x_weight"), (G, "_format"), (G, "_bits_gemm"), (G, "launch_relu_bits_persistent"),
    (T, "_backward_args"), (T, "_hot_backward"), (T, "entry_grads"), (T, "row_dx"), (T, "to_csc"),
    (T, "segment_axpy"), (T, "scatter_hot_rows"),
    # Every kept-kernel launch of both directions, and inside it the key, the argument list and the gate's
    # TMA descriptors (the rest of a launch is Triton's C launcher).
    (L.FastKernel, "run"), (L.FastKernel, "_key"), (L.FastKernel, "_values"), (TensorDescriptor, "from_tensor"),
]  # fmt: skip
BACKWARD = {
    "_backward_args",
    "_hot_backward",
    "entry_grads",
    "row_dx",
    "to_csc",
    "segment_axpy",
    "scatter_hot_rows",
}


class Count(TorchDispatchMode):
    """PyTorch operators issued inside the block (views included), by name."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def counts(x, ws) -> dict:
    """Operators and Triton launches of one forward and one backward (deferred sizes)."""
    launches = {"n": 0}
    run = L.FastKernel.run

    def counted(self, grid, args, kwargs):
        launches["n"] += 1
        return run(self, grid, args, kwargs)

    L.FastKernel.run = counted
    try:
        with T.deferred_sizes() as sizes:
            with Count() as fwd_ops:
                launches["n"] = 0
                out = T._EagerFFN.apply(x, *ws, ws[0], T.hot_units_for(x.shape[0], ws[0].shape[0]))
            fwd_launches = launches["n"]
            with Count() as bwd_ops:
                launches["n"] = 0
                torch.autograd.backward([out[0], out[1]], [torch.ones_like(out[0]), torch.ones_like(out[1])])
            bwd_launches = launches["n"]
            sizes.settle()
    finally:
        L.FastKernel.run = run
    return {
        "fwd_torch_ops": sum(fwd_ops.ops.values()), "fwd_fast_launches": fwd_launches, "fwd_ops": fwd_ops.ops,
        "bwd_torch_ops": sum(bwd_ops.ops.values()), "bwd_fast_launches": bwd_launches, "bwd_ops": bwd_ops.ops,
    }  # fmt: skip


def issued(fn):
    """(fn's result, host ms to run it): with the GPU busy behind a sleep kernel, the time to issue fn."""
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e3


def one_call(x, ws) -> tuple[float, float, dict]:
    """Host ms of one forward and one backward issued behind the sleep kernel, and the parts' seconds."""
    with T.deferred_sizes() as sizes:
        busy()
        spent.clear()
        out, fwd_ms = issued(lambda: T.twell_ffn(x, *ws))
        grads = [torch.ones_like(out.y), torch.ones_like(out.l1)]
        _, bwd_ms = issued(lambda: torch.autograd.backward([out.y, out.l1], grads))
        sizes.settle()
    for t in (*ws, x):
        t.grad = None
    return fwd_ms, bwd_ms, dict(spent)


def main(reps: int = 15) -> None:
    x, w_gate, w_up, w_down = paper_like_ffn_inputs(16384, 2048, 5632, device="cuda", seed=0)
    ws = [w.requires_grad_() for w in (w_gate, w_up, w_down)]
    x.requires_grad_()
    T.warm_up(16384, 2048, 5632, "cuda")
    # Class attributes as stored (a staticmethod stays one when restored); wrapped as plain functions.
    originals = {
        (m, name): (m.__dict__[name] if isinstance(m, type) else getattr(m, name)) for m, name in PARTS
    }
    for m, name in PARTS:
        setattr(m, name, timed(name, getattr(m, name)))
    try:
        samples = [one_call(x, ws) for _ in range(reps + 3)][3:]  # the first three: warm-up
    finally:
        for (m, name), fn in originals.items():
            setattr(m, name, fn)
    fwd, bwd, parts = zip(*samples)
    split = {name: statistics.median(p.get(name, 0.0) for p in parts) * 1e3 for _, name in PARTS}
    res = {"fwd_host_ms": statistics.median(fwd), "bwd_host_ms": statistics.median(bwd), "split_ms": split}
    top_fwd = ("relu_gate_bits", "count_fires", "hot_split", "build_pattern", "row_ffn_forward", "hot_forward",
               "_setup_context")  # fmt: skip
    res["fwd_rest_ms"] = res["fwd_host_ms"] - sum(split[n] for n in top_fwd)
    res["bwd_rest_ms"] = res["bwd_host_ms"] - sum(split[n] for n in BACKWARD)
    res["gate_rest_ms"] = split["relu_gate_bits"] - sum(
        split[n] for n in ("check_x_weight", "_format", "_bits_gemm", "launch_relu_bits_persistent")
    )
    res["launch_rest_ms"] = split["run"] - split["_key"] - split["_values"] - split["from_tensor"]
    res.update(counts(x, ws))
    print(json.dumps(res, indent=1))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
