"""What the benchmark scripts share: timing, the checks against the float32 reference, the JSON they
write and their inputs.

* timing: `median_ms` (triton's do_bench, median), `timed` / `timed_layers` (replayed from a CUDA
  graph, one FFN or a model's layers), `kernel_times` (the kernels one call launches, torch.profiler),
  `graphed_step` (a training step captured in one graph);
* tolerance: `row_errors` against the float32 FFN and `ROW_TOLERANCE` (inference), `step_errors`,
  `within_tolerance` and `mark_ok` (training: against the dense bf16 step's own errors);
* JSON: `write_results`, the file every bench script writes (device, rows, extra sections);
* inputs: `synthetic_inputs` (kernels/synthetic.py, seeded by the shape) with untimed calibration
  rows, `ordered_inputs` (units stored most-firing first), `load_activations` (a real model's dump).

It imports no bench script, so scripts/ has no import cycle (tests/test_scripts_imports.py).
"""

from __future__ import annotations

import json
import os
import time

import torch
import triton

from twell.kernels._common import check_ffn_args
from twell.kernels.bitmask import count_fires
from twell.kernels.gate import relu_gate_bits
from twell.kernels.inference.inference import unit_order
from twell.kernels.reference import relu_ffn_inference as dense_ffn
from twell.kernels.synthetic import paper_like_ffn_inputs
from twell.kernels.training.train import set_sizes, static_misses, twell_ffn

# ---- timing ---------------------------------------------------------------------------------------


def bench_device(parser, given: str | None, smoke: str, cpu_ok: bool = False) -> str:
    """--device as given; else cuda where there is a GPU, else cpu when the run is the smoke test itself
    (cpu_ok), else a parser error naming the smoke test: the presets these scripts time take hours on a
    CPU, with nothing printed meanwhile."""
    if given:
        return given
    if torch.cuda.is_available():
        return "cuda"
    if cpu_ok:
        return "cpu"
    parser.error(
        "no CUDA GPU here: this benchmark times the GPU, and its default models take hours on a CPU. "
        f"A smoke test on the CPU: {smoke}; --device cpu runs the full benchmark on the CPU anyway"
    )


def median_ms(fn, rep_ms: int) -> float:
    """Median ms of fn() over rep_ms of timing (triton.testing.do_bench: L2 flushed before each call)."""
    return triton.testing.do_bench(fn, rep=rep_ms, return_mode="median")


def timed(fn, use_graph: bool, rep_ms: int) -> float:
    """Median ms of fn() (triton.testing.do_bench), replayed from a CUDA graph for small batches."""
    if use_graph:
        return timed_layers(lambda _: fn(), 1, rep_ms)
    return median_ms(fn, rep_ms)


def timed_layers(call, n_layers: int, rep_ms: int) -> float:
    """Median ms per layer of one CUDA graph that holds `call(i)` for i = 0 .. n_layers - 1, each
    layer on its own weights, as a captured decode step of a model holds its layers: the fixed cost
    of launching a graph is shared by the layers instead of charged to one FFN, while every kernel
    boundary inside the graph still counts. do_bench flushes L2 before each replay, and each layer's
    weights are its own memory, so no layer reads another's from cache."""
    for i in range(n_layers):  # compile / autotune outside the capture
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call(0)
        with torch.cuda.graph(graph, stream=stream):
            for i in range(n_layers):
                call(i)
    torch.cuda.synchronize()
    return median_ms(graph.replay, rep_ms) / n_layers


def kernel_times(fn) -> tuple[list[dict], float]:
    """The GPU kernels one call of fn() launches, in launch order, with their times (torch.profiler),
    and the wall ms of one unprofiled call from launch to synchronize (GPU time + launch gaps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [
        {"kernel": e.name, "us": e.time_range.elapsed_us(), "start": e.time_range.start}
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
    kernels.sort(key=lambda k: k["start"])
    return [{"kernel": k["kernel"], "us": k["us"]} for k in kernels], sorted(walls)[len(walls) // 2]


def print_kernel_times(title: str, kernels: list[dict], wall_ms: float, min_us: float = 0.0) -> None:
    total = sum(k["us"] for k in kernels)
    print(
        f"\n{title}: {len(kernels)} kernels, {total / 1e3:.3f} ms of GPU time, "
        f"{wall_ms:.3f} ms wall (launch to synchronize, median of 5)"
    )
    for k in kernels:
        if k["us"] >= min_us:
            print(f"  {k['us']:8.1f} us  {k['kernel'][:90]}")


# ---- tolerance: inference -------------------------------------------------------------------------

ROW_TOLERANCE = 1e-2  # an FFN output is correct when every row's relative error is below this


def row_errors(y, x, w_gate, w_up, w_down) -> torch.Tensor:
    """Relative error of each row of y against the float32 FFN of the same inputs."""
    ref = dense_ffn(*(t.float() for t in (x, w_gate, w_up, w_down)))
    return (y.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)


# ---- the training step and its tolerance ----------------------------------------------------------

L1_COEF = 2e-5  # the paper's coefficient
GRAD_NAMES = ("dx", "dw_gate", "dw_up", "dw_down")


def dense_ffn_l1(x, w_gate, w_up, w_down):
    """What a dense model layer runs: the FFN and its L1 term (mean over tokens of sum |h|).

    The fp32 sum without an fp32 copy of h: abs() saves the h the down matmul saves anyway."""
    h = torch.relu(x @ w_gate.T) * (x @ w_up.T)
    return h @ w_down, h.abs().sum(dim=-1, dtype=torch.float32).mean()


def twell_y_l1(x, w_gate, w_up, w_down):
    """twell_ffn as dense_ffn_l1 returns it: (y, the L1 term)."""
    out = twell_ffn(x, w_gate, w_up, w_down)
    return out.y, out.l1


_L1_GRAD: dict = {}


def l1_grad(device) -> torch.Tensor:
    """The L1 term's upstream gradient, made once per device: a per-step torch.tensor(..., device=cuda)
    would be a host-to-device copy inside the timed step, which a training loop does not do."""
    if device not in _L1_GRAD:
        _L1_GRAD[device] = torch.tensor(L1_COEF, device=device)
    return _L1_GRAD[device]


# The open kernels.training.train.DeferredSizes of a step timed under deferred sizes (bench_train --sizes
# deferred): each step settles it, as the trainer does. None: nothing to settle.
SETTLE: list = [None]


def train_step(fn, leaves, grad_y) -> torch.Tensor:
    """One forward + backward with fresh gradients (and, under deferred sizes, the step's settle: one
    host sync, as in the trainer); returns y."""
    for t in leaves:
        t.grad = None
    y, l1 = fn(*leaves)
    torch.autograd.backward([y, l1], [grad_y, l1_grad(y.device)])
    settle_step()
    return y


def settle_step() -> None:
    """The step's settle under deferred sizes (SETTLE; one host sync, as in the trainer); no-op otherwise."""
    if SETTLE[0] is not None and SETTLE[0].settle():
        raise RuntimeError(
            "a deferred TwELL call missed its capacity in the benchmark (inputs do not change)"
        )


def rel_error(a, b) -> float:
    """Relative error of a against the float32 reference b (whole tensor, Frobenius norm)."""
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()


def step_errors(fn, leaves, grad_y, ref) -> dict:
    """err_y and err_<gradient> of one step of fn against the fp32 reference (prepare_step's ref)."""
    train_step(fn, leaves, grad_y)
    with torch.no_grad():
        y, _ = fn(*leaves)
    out = {"err_y": rel_error(y, ref["y"])}
    out.update({f"err_{n}": rel_error(t.grad, ref[n]) for n, t in zip(GRAD_NAMES, leaves)})
    return out


def _reference(inputs, grad_y) -> dict:
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    torch.backends.cuda.matmul.allow_tf32 = False
    train_step(dense_ffn_l1, leaves, grad_y.float())
    with torch.no_grad():
        y, _ = dense_ffn_l1(*leaves)
    ref = {"y": y}
    ref.update({n: t.grad for n, t in zip(GRAD_NAMES, leaves)})
    return ref


def prepare_step(inputs) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    """What every timed step works on: leaf copies of the four inputs requiring grad, a random grad_y
    [M, D] in x's dtype and device, and the fp32 reference of y and the four gradients."""
    x = inputs[0]
    grad_y = torch.randn(x.shape, device=x.device, dtype=x.dtype)
    ref = _reference(inputs, grad_y)
    leaves = [t.clone().requires_grad_() for t in inputs]
    return leaves, grad_y, ref


def within_tolerance(err: float, dense_err: float) -> bool:
    """The benchmarks' bar for an output or gradient: within 3x the dense bf16 step's own error of it
    (the rounding level) or 1e-2."""
    return err <= max(3 * dense_err, 1e-2)


def mark_ok(rows: list[dict]) -> None:
    """`ok`: y and every gradient within_tolerance of the dense-bf16 error (rows[0] is the dense eager
    row)."""
    dense = rows[0]
    for r in rows:
        errs = [k for k in r if k.startswith("err_")]
        r["ok"] = all(within_tolerance(r[k], dense[k]) for k in errs)


def graphed_step(fn, leaves, grad_y, ref, rep: int, twell: bool) -> dict:
    """The step captured in one CUDA graph (what a training loop with whole-step graphs runs: no host
    issue cost), timed by replaying it; also the replay's gradient errors against the fp32 reference
    and, for TwELL, static_misses (calls whose fixed entry capacity did not hold: must be 0).
    TwELL warms up at its static sizes first (the capture takes them; autotuning cannot run inside a
    capture)."""
    device = leaves[0].device
    if twell:
        set_sizes("static")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Leaves first used on this side stream (as in PyTorch's whole-network capture recipe): their
            # gradient accumulators must not belong to the legacy default stream, which a capture
            # cannot wait on. TwELL's layer history follows w_gate, so the eager calls below make it.
            leaves = [t.detach().clone().requires_grad_() for t in leaves]
            for _ in range(3):
                train_step(fn, leaves, grad_y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for t in leaves:
            t.grad = None
        with torch.cuda.graph(graph):
            y = train_step(fn, leaves, grad_y)
    finally:
        set_sizes("estimate")
    misses = static_misses(device)
    misses.zero_()
    graph.replay()
    torch.cuda.synchronize()
    errs = {f"graph_err_{n}": rel_error(t.grad, ref[n]) for n, t in zip(GRAD_NAMES, leaves)}
    errs["graph_err_y"] = rel_error(y, ref["y"])
    ms = median_ms(graph.replay, rep)
    out = {"graph_fwd_bwd_ms": ms, "graph_misses": int(misses), **errs}
    for t in leaves:
        t.grad = None
    del graph
    return out


# ---- JSON -----------------------------------------------------------------------------------------


def write_results(path: str, rows: list[dict], *, quiet: bool = False, **extra) -> None:
    """The JSON every bench script writes: the GPU's name, one dict per measurement, and any extra
    non-None sections (e.g. per-kernel profiles). quiet: no "wrote PATH" line."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"device": device, "rows": rows}
    doc.update({k: v for k, v in extra.items() if v is not None})
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if not quiet:
        print(f"wrote {path}")


# ---- inputs ---------------------------------------------------------------------------------------

CALIBRATION_ROWS = 4096  # untimed rows that order the units (--hot-prefix, --ordered)


def synthetic_inputs(M: int, D: int, F: int, calibration_rows: int = 0):
    """((x [M, D], w_gate, w_up, w_down [F, D]), calibration rows [calibration_rows, D] or None):
    paper-like bf16 inputs on the GPU from kernels/synthetic.py, seeded M + F, the calibration rows
    fresh rows of the same layer (never timed)."""
    x, *weights = paper_like_ffn_inputs(M + calibration_rows, D, F, device="cuda", seed=M + F)
    return (x[:M].contiguous(), *weights), (x[M:] if calibration_rows else None)


def calibrated_order(cal: torch.Tensor, w_gate: torch.Tensor) -> torch.Tensor:
    """Units by firing count on the calibration rows, most first (ties by index): the order a model's
    units would be stored in for hot_prefix (a property of the weights, chosen once)."""
    return unit_order(count_fires(relu_gate_bits(cal, w_gate)[1]))  # the kernels' own positives


def ordered_weights(cal, weights) -> tuple[torch.Tensor, tuple]:
    """(calibrated_order on rows cal, the three weights permuted to it, contiguous)."""
    order = calibrated_order(cal, weights[0])
    return order, tuple(w[order].contiguous() for w in weights)


def ordered_inputs(M: int, D: int, F: int):
    """synthetic_inputs with the units stored most-firing first on CALIBRATION_ROWS untimed rows, as
    Transformer.order_ffn_units leaves a model (what the hot prefix runs on)."""
    (x, *weights), cal = synthetic_inputs(M, D, F, CALIBRATION_ROWS)
    return (x, *ordered_weights(cal, weights)[1])


ACTIVATION_KEYS = ("x", "w_gate", "w_up", "w_down")  # what scripts/activity.py --dump-ffn-inputs writes
DUMP_FIX = "write one with: python scripts/activity.py checkpoint=... --val-rows 8 --dump-ffn-inputs PATH"


class BadActivations(ValueError):
    """An --activations file that cannot be benchmarked; the message names the file and the fix."""


def load_activations(
    path, *, tokens: int | None = None, dtype: torch.dtype = torch.bfloat16, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, D], w_gate, w_up, w_down [F, D] from a `scripts/activity.py --dump-ffn-inputs` file.

    The dump holds the FFN's weights as the model stores them: w_gate and w_up in nn.Linear layout
    [d_ff, d_model], w_down neuron-major [d_ff, d_model], which is exactly the layout twell_ffn and
    dense_ffn_l1 take (y = h @ w_down), so nothing is transposed. `tokens` keeps the first N rows of x
    (None: all of them). The four tensors come back contiguous, in `dtype` (the bench's bf16), on
    `device`, and pass twell_ffn's argument checks; any problem raises BadActivations.
    """
    if not os.path.isfile(path):
        raise BadActivations(f"--activations {path}: no such file; {DUMP_FIX}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file gets the same advice
        raise BadActivations(
            f"--activations {path}: cannot read it with torch.load ({err}); {DUMP_FIX}"
        ) from err
    if not isinstance(blob, dict):
        raise BadActivations(
            f"--activations {path}: holds a {type(blob).__name__}, not a dict with keys {ACTIVATION_KEYS}; {DUMP_FIX}"
        )
    missing = [k for k in ACTIVATION_KEYS if not isinstance(blob.get(k), torch.Tensor)]
    if missing:
        raise BadActivations(
            f"--activations {path}: no tensor under {missing} (it has keys {sorted(map(str, blob))}); "
            f"the bench needs {list(ACTIVATION_KEYS)}; {DUMP_FIX}"
        )
    x, w_gate, w_up, w_down = (blob[k] for k in ACTIVATION_KEYS)
    for name, t in zip(ACTIVATION_KEYS, (x, w_gate, w_up, w_down)):
        if t.dim() != 2 or not t.is_floating_point():
            raise BadActivations(
                f"--activations {path}: {name} is a {t.dim()}-D {t.dtype} tensor of shape {tuple(t.shape)}; "
                f"x must be [tokens, d_model] and the weights [d_ff, d_model], floating point; {DUMP_FIX}"
            )
    M, D = x.shape
    F = w_gate.shape[0]
    if w_gate.shape != (F, D) or w_up.shape != (F, D):
        raise BadActivations(
            f"--activations {path}: x is [{M}, {D}] but w_gate is {list(w_gate.shape)} and w_up "
            f"{list(w_up.shape)}; both must be [d_ff, d_model={D}] (nn.Linear layout); {DUMP_FIX}"
        )
    if w_down.shape != (F, D):
        hint = (
            "it looks like nn.Linear's [d_model, d_ff] layout: store w_down.t().contiguous() (neuron-major)"
            if w_down.shape == (D, F)
            else DUMP_FIX
        )
        raise BadActivations(
            f"--activations {path}: w_down is {list(w_down.shape)} but must be neuron-major [d_ff={F}, "
            f"d_model={D}] like w_gate; {hint}"
        )
    if tokens is not None:
        if not 1 <= tokens <= M:
            raise BadActivations(
                f"--activations {path}: --tokens {tokens} must be in 1..{M} (the dump's rows); "
                "leave --tokens out to use every row"
            )
        x = x[:tokens]
    out = tuple(t.to(device=device, dtype=dtype).contiguous() for t in (x, w_gate, w_up, w_down))
    try:
        check_ffn_args(*out)
    except ValueError as err:
        raise BadActivations(f"--activations {path}: {err}") from err
    return out
