"""kernels/_launch.py: Triton launches through the kept compiled kernels.

On a CPU (Triton's interpreter) every call takes Triton's own path: the keys are checked here; the fast
path itself, against Triton's, on a GPU (marked gpu)."""

import pytest
import torch
import triton
import triton.language as tl

from twell.kernels import _launch
from twell.kernels._common import interpreting
from twell.kernels._launch import _arg_key, _Unkeyable, fast, fast_launch_enabled, set_fast_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    xv = tl.load(x_ptr + offs, mask=ok).to(tl.float32)
    yv = tl.load(y_ptr + offs, mask=ok).to(tl.float32)
    tl.store(out_ptr + offs, (a * xv + yv).to(out_ptr.dtype.element_ty), mask=ok)


_FAST_AXPY = fast(_axpy_kernel)
_FAST_HEURISTIC_AXPY = fast(
    triton.heuristics({"BLOCK": lambda args: 32 if args["n"] < 64 else 128})(_axpy_kernel)
)
# The autotuner times its candidates on a GPU only (the interpreter has no driver to time with).
_FAST_TUNED_AXPY = fast(
    triton.autotune(
        [triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4)], key=["n"]
    )(_axpy_kernel)
)
WRAPPED = [
    pytest.param(_FAST_AXPY, id="jit"),
    pytest.param(_FAST_HEURISTIC_AXPY, id="heuristics"),
    pytest.param(_FAST_TUNED_AXPY, id="autotuned", marks=pytest.mark.gpu),
]


def test_keys_separate_what_triton_specializes_on():
    base = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(base) == (torch.float32, True)
    assert _arg_key(base[1:]) == (torch.float32, False)  # 4 bytes past a 16-byte boundary
    assert _arg_key(base.to(torch.bfloat16))[0] == torch.bfloat16
    assert len({_arg_key(v) for v in (1, 2, 16, 32, 17, 2**31, 2**40, 2**63)}) == 5
    assert _arg_key(16) == _arg_key(32) and _arg_key(2) == _arg_key(17)
    assert _arg_key(2**31) != _arg_key(2**31 - 16)  # 64-bit against 32-bit
    assert _arg_key(True) != _arg_key(False) and _arg_key(True) != _arg_key(1)
    assert _arg_key(0.5) == _arg_key(3.0) and _arg_key(None) is None
    with pytest.raises(_Unkeyable):
        _arg_key("a string argument")


def test_tensor_descriptors_are_keyed_by_dtype_and_block_shape():
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.zeros(128, 128, dtype=torch.bfloat16)
    a, b = TensorDescriptor.from_tensor(t, [64, 64]), TensorDescriptor.from_tensor(t, [32, 64])
    assert _arg_key(a) == _arg_key(TensorDescriptor.from_tensor(t.clone(), [64, 64]))
    assert _arg_key(a) != _arg_key(b)


def test_switch_and_interpreter_send_calls_through_triton():
    assert fast_launch_enabled() == (not interpreting())
    try:
        set_fast_launch(False)
        assert not fast_launch_enabled()
    finally:
        set_fast_launch(True)


def _axpy(fn, x, y, a, block=None):
    out = torch.empty_like(x)
    n = x.numel()
    if block is None:
        fn[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, a, n)
    else:
        fn[(triton.cdiv(n, block),)](x, y, out, a, n, BLOCK=block)
    return out


@pytest.mark.parametrize("fn", WRAPPED)
def test_launches_equal_tritons_own_on_every_signature(fn):
    """Aligned and misaligned tensors, n of every int class, two dtypes, a float scalar: each call's
    result equals the PyTorch reference, first calls (Triton's path) and repeated ones (kept kernels)."""
    gen = torch.Generator().manual_seed(0)
    block = 64 if fn is _FAST_AXPY else None
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.randn(3, 1000, generator=gen).to(DEVICE, dtype)
        for n in (1, 16, 17, 256, 999):
            for offset in (0, 1):  # offset 1: not 16-byte aligned
                x, y = base[0, offset : offset + n], base[1, offset : offset + n]
                for a in (0.5, -2.0):
                    for _ in range(2):
                        out = _axpy(fn, x, y, a, block)
                        ref = (a * x.float() + y.float()).to(dtype)
                        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # one bf16 ulp: casts may truncate
                        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_fast_path_is_taken_and_kept_per_signature():
    x = torch.randn(4096, device="cuda")
    _FAST_AXPY._ready and _FAST_AXPY._sites.clear()
    for _ in range(3):
        _axpy(_FAST_AXPY, x, x, 1.0, 64)
    assert len(_FAST_AXPY._sites) == 1
    _axpy(_FAST_AXPY, x[1:], x[1:], 1.0, 64)  # misaligned and n odd: a second kept kernel
    sites = list(_FAST_AXPY._sites.values())
    assert len(sites) == 2 and sites[0].compiled is not sites[1].compiled


@pytest.mark.gpu
def test_training_op_is_bit_identical_through_either_path():
    """twell_ffn forward and backward (hot units, the tuned kernels, the gate GEMM's TMA descriptors and
    pre-hook) give the same bits with kept kernels as through Triton's front end."""
    from twell.kernels.synthetic import paper_like_ffn_inputs
    from twell.kernels.training import train_format, train_rowfwd
    from twell.kernels.training.train import twell_ffn

    x, *ws = paper_like_ffn_inputs(2048, 256, 1024, device="cuda", seed=3)

    def step():
        leaves = [t.detach().clone().requires_grad_() for t in (x, *ws)]
        out = twell_ffn(*leaves, hot_units=128)
        torch.autograd.backward([out.y, out.l1], [torch.ones_like(out.y), torch.ones_like(out.l1)])
        return [out.y, out.l1, out.row_active, out.unit_fires] + [t.grad for t in leaves]

    try:
        set_fast_launch(False)
        want = step()
        set_fast_launch(True)
        step()  # records the kept kernels
        got = step()
    finally:
        set_fast_launch(True)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert train_format._COMPACT_CSR._sites and train_rowfwd._ROW_FWD._sites
    assert _launch.fast_launch_enabled()


def test_launch_hooks_set_by_a_profiler_send_calls_through_triton():
    from triton.knobs import HookChain

    chain = HookChain()
    assert not _launch._hooked(None) and not _launch._hooked(chain)
    chain.add(lambda metadata: None)
    assert _launch._hooked(chain) and _launch._hooked(lambda metadata: None)


def test_wrappers_are_unwrapped_down_to_the_compiled_function():
    """Autotuner and heuristics are peeled outside-in; an interpreter's kernel (or anything but a JIT
    function) leaves no compiled function, so its calls always take Triton's path."""
    jit, wrappers = _launch._layers(_FAST_TUNED_AXPY.kernel)
    assert wrappers == [_FAST_TUNED_AXPY.kernel]
    assert (jit is None) == interpreting()
    assert _launch._layers(lambda: None) == (None, [])
