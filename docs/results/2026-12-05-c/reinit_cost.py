"""Issue 30/31: what the trainer's per-step sparsity work costs at 1.5b (28 layers, w_gate [5632, 2048] fp32
masters with AdamW moments): ActivityTracker.end_step + reinit_dead_gate_rows, host issue time and GPU time
per step, with 0.5% and 30% of the units dead; the re-init as PyTorch draws it (the whole matrix) and as
kernels/reinit.py does (the dead rows only).

    python docs/results/2026-12-05-c/reinit_cost.py
"""

import time

import torch

from twell.training.sparsity import ActivityTracker, reinit_dead_gate_rows

L, F, D = 28, 5632, 2048


def main() -> None:
    dev = torch.device("cuda")
    weights = [torch.nn.Parameter(torch.randn(F, D, device=dev) * 0.02) for _ in range(L)]
    opt = torch.optim.AdamW(weights, lr=1e-4, fused=True)
    for w in weights:
        w.grad = torch.zeros_like(w)
    opt.step()
    tracker = ActivityTracker(L, F, dev, dead_window_tokens=1 << 20)
    for frac in (0.005, 0.3):
        dead = torch.rand(L, F, device=dev) < frac
        for label, fn in (
            ("end_step", lambda: tracker.end_step(1)),
            (
                "reinit torch",
                lambda d=dead: reinit_dead_gate_rows(weights, d, 1, 0, 0.1, 0.02, opt, kernel=False),
            ),
            (
                "reinit kernel",
                lambda d=dead: reinit_dead_gate_rows(weights, d, 1, 0, 0.1, 0.02, opt, kernel=True),
            ),
        ):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            n = 20
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(n):
                fn()
            host = (time.perf_counter() - t0) / n * 1e3
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) / n
            print(
                f"dead {frac:5.3f} {label:13s} host issue {host:7.3f} ms/step, GPU+host wall {wall:7.3f} ms/step"
            )


if __name__ == "__main__":
    main()
