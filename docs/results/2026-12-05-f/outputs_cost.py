"""What the number of a custom op's outputs costs the host in a torch.compile'd block (CPU, no GPU needed):

    python docs/results/2026-12-05-f/outputs_cost.py

The training op returns 15 tensors (y, l1, three statistics and the 10 tensors its backward needs), each an
output of twell::ffn_train_fwd that AOTAutograd's runtime wraps and saves. Could packing the saved state
into fewer tensors cut the compiled step's host time (issue 31)? This times a stand-in op with the same
structure (custom forward and backward ops, register_autograd, the extra outputs saved for backward) at 15,
6 and 2 outputs, compiled with fullgraph=True on 8 x 8 CPU tensors, so that what is timed is the
framework's per-call Python, the same on any device. Median of 5 rounds of 2,000 calls.
"""

import statistics
import time

import torch
from torch import Tensor


def stand_in(n_out: int):
    """A custom op x @ w returning n_out tensors (n_out - 1 of them saved for backward), with autograd."""

    def forward(x, w):
        return (x @ w, *(torch.empty(4) for _ in range(n_out - 1)))

    forward.__annotations__ = {"x": Tensor, "w": Tensor, "return": tuple[tuple([Tensor] * n_out)]}
    op = torch.library.custom_op(f"outputs_cost::fwd{n_out}", mutates_args=())(forward)

    @op.register_fake
    def _(x, w):
        return (x.new_empty(x.shape[0], w.shape[1]), *(x.new_empty(4) for _ in range(n_out - 1)))

    @torch.library.custom_op(f"outputs_cost::bwd{n_out}", mutates_args=())
    def backward_op(g: Tensor, x: Tensor, w: Tensor, saved: list[Tensor]) -> tuple[Tensor, Tensor]:
        return g @ w.T, x.T @ g

    @backward_op.register_fake
    def _(g, x, w, saved):
        return x.new_empty(x.shape), w.new_empty(w.shape)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, *output[1:])

    def backward(ctx, g, *unused):
        x, w, *saved = ctx.saved_tensors
        return backward_op(g, x, w, saved)

    op.register_autograd(backward, setup_context=setup_context)
    return op


def per_call_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    print("| outputs | compiled forward us | forward + backward us |\n|---|---|---|")
    for n_out in (15, 6, 2):
        op = stand_in(n_out)
        block = torch.compile(lambda x, w, op=op: torch.relu(op(x, w)[0]) + 1, fullgraph=True)
        for _ in range(20):
            block(x, w).sum().backward()
        fwd = per_call_us(lambda block=block: block(x, w))
        step = per_call_us(lambda block=block: block(x, w).sum().backward())
        print(f"| {n_out} | {fwd:.1f} | {step:.1f} |")


if __name__ == "__main__":
    main()
