"""Launches and aten operators one fwd+bwd of the TwELL training op issues from the host (issue 31),
counted on the CPU through Triton's interpreter (counts, not times: the same calls a GPU host makes),
for the eager path under deferred sizes as the trainer runs it (third call: capacities sized).

    TRITON_INTERPRET=1 python docs/results/2026-12-05-b/op_census.py [hot_units]
"""

import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import KernelInterface

from twell.kernels.synthetic import paper_like_ffn_inputs
from twell.kernels.training import train

launches: collections.Counter = collections.Counter()
aten: collections.Counter = collections.Counter()
state = {"phase": "fwd", "inside": 0}
_getitem = KernelInterface.__getitem__


def counted_getitem(kernel, grid):
    run = _getitem(kernel, grid)
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?")

    def launch(*args, **kwargs):
        launches[state["phase"], name] += 1
        state["inside"] += 1  # the interpreter's own tensor work is not the host's
        try:
            return run(*args, **kwargs)
        finally:
            state["inside"] -= 1

    return launch


class CountAten(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not state["inside"]:
            aten[state["phase"], str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    KernelInterface.__getitem__ = counted_getitem
    train.set_hot_units(k)
    x, w_gate, w_up, w_down = paper_like_ffn_inputs(1024, 128, 512, device="cpu", seed=0)
    weights = [w.requires_grad_() for w in (w_gate, w_up, w_down)]
    x.requires_grad_()
    with train.deferred_sizes() as sizes:
        for call in range(3):
            counting = CountAten() if call == 2 else None
            launches.clear()
            aten.clear()
            state["phase"] = "fwd"
            with counting or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = train._EagerFFN.apply(x, *weights, weights[0], k)
            state["phase"] = "bwd"
            y, l1 = out[:2]
            grads = [torch.ones_like(y), torch.ones_like(l1)]  # the caller's, not counted
            with counting or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                torch.autograd.backward([y, l1], grads)
            sizes.settle()
    for phase in ("fwd", "bwd"):
        ours = {n: c for (p, n), c in launches.items() if p == phase}
        ops = {n: c for (p, n), c in aten.items() if p == phase}
        print(f"{phase}: {sum(ours.values())} Triton launches, {sum(ops.values())} aten operators")
        for name, count in sorted(ours.items()):
            print(f"  launch {count} {name}")
        for name, count in sorted(ops.items(), key=lambda kv: -kv[1]):
            print(f"  aten   {count} {name}")


if __name__ == "__main__":
    main()
