"""Host cost of one launch on the GPU's host (issue 31), to be run on the device: a Triton kernel through
jit[grid], through an autotuner with one config, through heuristics + autotune (as the TwELL kernels are
wrapped) and through the compiled kernel's own launcher, beside torch.empty and small aten ops.

    python docs/results/2026-12-05-b/launch_probe.py out.json
"""

import json
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


ONE_CONFIG = [triton.Config({"BLOCK": 256}, num_warps=4)]
tuned = triton.autotune(ONE_CONFIG, key=["n"])(triton.jit(copy_kernel.fn))
wrapped = triton.heuristics({"UNUSED": lambda args: 1})(
    triton.autotune(ONE_CONFIG, key=["n"])(triton.jit(copy_kernel.fn))
)


def host_us(fn, reps: int = 2000) -> float:
    """Host microseconds a call (the GPU work is tiny: the host's issue rate is what is timed)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    return elapsed


def main() -> None:
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    n = x.numel()
    grid = (16,)
    res = {
        "jit[grid]": host_us(lambda: copy_kernel[grid](x, y, n, BLOCK=256)),
        "jit[grid], grid as a lambda": host_us(
            lambda: copy_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, BLOCK=256)
        ),
        "autotune (one config)": host_us(lambda: tuned[grid](x, y, n)),
    }
    try:
        res["heuristics + autotune"] = host_us(lambda: wrapped[grid](x, y, n))
    except Exception as err:  # noqa: BLE001 - a probe: report what failed
        res["heuristics + autotune"] = repr(err)[:200]
    compiled = copy_kernel[grid](x, y, n, BLOCK=256)
    try:
        stream = torch.cuda.current_stream().cuda_stream
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        res["CompiledKernel.run"] = host_us(
            lambda: run(16, 1, 1, stream, function, metadata, None, None, None, x, y, n)
        )
    except Exception as err:  # noqa: BLE001
        res["CompiledKernel.run"] = repr(err)[:200]
    idx = torch.arange(64, device="cuda")
    w = torch.randn(256, 64, device="cuda")
    side = torch.cuda.Stream()

    def fork_join():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pass
        torch.cuda.current_stream().wait_stream(side)

    res.update({
        "torch.empty": host_us(lambda: torch.empty(4096, device="cuda")),
        "index_select": host_us(lambda: torch.index_select(w, 0, idx)),
        "add_": host_us(lambda: x.add_(1)),
        "mm 64x64": host_us(lambda: torch.mm(w[:64], w[:64])),
        "side stream fork + join": host_us(fork_join),
    })  # fmt: skip
    for name, value in res.items():
        print(f"{name:30s} {value if isinstance(value, str) else f'{value:7.2f} us'}")
    print("triton", triton.__version__, "torch", torch.__version__)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
