"""Shared checks and helpers for the TwELL kernels (torch + triton only)."""

from __future__ import annotations

import functools
import operator
import os

import torch
import triton

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _count_or_minus_one(k) -> int:
    """k as an int if it is a non-negative integer of any integer type but bool, else -1."""
    try:
        value = operator.index(k)
    except TypeError:
        return -1
    return -1 if isinstance(k, bool) or value < 0 else value


def check_hot_units(k, name: str = "hot_units", default: str = "None") -> int | None:
    """None (the kernels' default) or k as an int >= 0 (any integer type, not bool); anything else is a
    ValueError naming `name` (the argument or config key the caller was given) and `default` (how the
    caller spells None)."""
    if k is None:
        return None
    value = _count_or_minus_one(k)
    if value < 0:
        raise ValueError(
            f"{name}={k!r} must be an integer >= 0 (0 turns hot units off) or {default} (the default)"
        )
    return value


def check_hot_prefix(p, F: int, name: str = "hot_prefix") -> int:
    """p as an int in [0, F], a multiple of 32 (whole words of the gate's bitmask); else a ValueError
    naming `name` and the fix."""
    value = _count_or_minus_one(p)
    if value < 0 or value % 32 or value > F:
        raise ValueError(
            f"{name}={p!r} must be a multiple of 32 in [0, d_ff={F}] (0: off); e.g. {min(512, F // 32 * 32)}"
        )
    return value


@functools.cache
def device_major(device: torch.device) -> int:
    """The CUDA device's compute capability major (kept: asked on every launch of the gate GEMM)."""
    return torch.cuda.get_device_capability(device)[0]


@functools.cache
def sm_count(device: torch.device) -> int:
    """The CUDA device's multiprocessor count (kept: asked on every launch of the persistent kernels)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can carry these tensors: Hopper or later (the interpreter emulates them)
    and 16-byte aligned bases and row strides."""
    if not interpreting() and device_major(tensors[0].device) < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast tl.dot operands to fp32.

    Triton's interpreter (3.6 and later) returns wrong tl.dot results for 16-bit operands, so under
    the interpreter we upcast; on a GPU 16-bit operands go straight to the tensor cores.
    """
    return interpreting() and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs must not be silently rounded to tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def triton_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def check_x_weight(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    """Validate x [M, D] against one [F, D] weight; raise ValueError naming the value and the fix."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, d_model] (got shape {tuple(x.shape)}); reshape it first")
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D [d_ff, d_model] (got shape {tuple(w.shape)})")
    m, d = x.shape
    f, dw = w.shape
    if m < 1:
        raise ValueError(f"x has {m} rows; at least one token is needed")
    if d % 64 != 0:
        raise ValueError(f"d_model={d} must be a multiple of 64 (pad the model width)")
    if f % 64 != 0:
        raise ValueError(f"d_ff={f} must be a multiple of 64 (got {f}); pad {name} with zero rows")
    if dw != d:
        raise ValueError(f"{name} has d_model={dw} but x has d_model={d}; {name} must be [d_ff, d_model]")
    for tensor, label in ((x, "x"), (w, name)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{label}.dtype={tensor.dtype} is not supported; use bfloat16, float16 or float32"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{label} must be contiguous (strides {tensor.stride()}); call .contiguous()")
    if w.dtype != x.dtype:
        raise ValueError(f"{name}.dtype={w.dtype} differs from x.dtype={x.dtype}; cast both to one dtype")
    if w.device != x.device:
        raise ValueError(f"{name} is on {w.device} but x is on {x.device}; move them to one device")


def check_ffn_args(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """Validate the four FFN operands (x [M, D]; w_gate, w_up, w_down [F, D], w_down neuron-major)."""
    check_x_weight(x, w_gate, "w_gate")
    for w, name in ((w_up, "w_up"), (w_down, "w_down")):
        check_x_weight(x, w, name)
        if w.shape != w_gate.shape:
            raise ValueError(
                f"{name} has shape {tuple(w.shape)} but w_gate has {tuple(w_gate.shape)}; all three "
                "weights must be [d_ff, d_model] (w_down neuron-major: the transpose of nn.Linear's weight)"
            )


def check_kernel_device(x: torch.Tensor) -> None:
    """Triton kernels need a CUDA tensor, or CPU tensors under the interpreter."""
    if x.device.type == "cuda":
        return
    if x.device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"x is on {x.device}; the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 for CPU "
        "(set before importing triton). Use kernels.reference.relu_ffn on other devices."
    )


def autotune(configs, key, **kwargs):
    """triton.autotune whose choices are also kept on disk (in Triton's cache, keyed by the kernel's
    source, the GPU and the key values): a later process, a resumed run or the second twin of a race,
    starts with the tuned configurations instead of timing every candidate again mid-run. Not under the
    interpreter, whose timings mean nothing."""
    return triton.autotune(configs=configs, key=key, cache_results=not interpreting(), **kwargs)
