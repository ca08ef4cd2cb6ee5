"""Where the TwELL training op's host time goes, measured without a profiler (issue 31), on the device:

    python docs/results/2026-12-05-e/host_split.py out.json

Every timed call is issued while the GPU runs a long sleep kernel queued before it, so the host never waits
for the GPU and what is timed is the host's issue time alone (sizes: deferred, nothing is read back). Rows:
(1) the op's forward and backward at 16,384 x 2048 x 5632 bf16 (paper-like inputs, hot units on), with the
forward's host time split by the functions `_forward` calls (timing wrappers, ~0.3 us each); Each twice (SETTINGS): the host path before session (e), then after it. (2) a 4-layer
model of the 1.5b width, blocks compiled as the trainer compiles them, under bf16 autocast: host time of
its forward and backward, dense FFNs against TwELL, per layer.
"""

import json
import statistics
import sys
import time

import torch

import twell.kernels.training.train as T
from twell.kernels._launch import set_fast_launch
from twell.kernels.synthetic import paper_like_ffn_inputs

# The host paths compared: before session (e) (launches through Triton's front end, the hot units' GEMMs
# on a side stream) and after it (kept compiled kernels, one stream outside CUDA graphs).
SETTINGS = {"before": (False, True), "after": (True, "auto")}


def use(name: str) -> None:
    fast, streams = SETTINGS[name]
    set_fast_launch(fast)
    T.set_streams(streams)


SLEEP = int(4e8)  # ~0.2 s of GPU time at ~1.98 GHz: longer than any host stretch timed below
SPLIT = ("relu_gate_bits", "count_fires", "hot_split", "build_pattern", "row_ffn_forward", "hot_forward",
         "_on", "_join")  # fmt: skip
spent: dict[str, float] = {}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


def busy() -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)


def op_rows(reps: int = 15) -> dict:
    x, w_gate, w_up, w_down = paper_like_ffn_inputs(16384, 2048, 5632, device="cuda", seed=0)
    ws = [w.requires_grad_() for w in (w_gate, w_up, w_down)]
    x.requires_grad_()
    T.warm_up(16384, 2048, 5632, "cuda")
    fwd, bwd, parts = [], [], []
    originals = {name: getattr(T, name) for name in SPLIT}
    for name in SPLIT:
        setattr(T, name, timed(name, originals[name]))
    try:
        for i in range(reps + 3):
            with T.deferred_sizes() as sizes:
                busy()
                spent.clear()
                t0 = time.perf_counter()
                out = T.twell_ffn(x, *ws)
                t1 = time.perf_counter()
                torch.autograd.backward([out.y, out.l1], [torch.ones_like(out.y), torch.ones_like(out.l1)])
                t2 = time.perf_counter()
                sizes.settle()
            if i >= 3:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
                parts.append(dict(spent))
            for w in ws + [x]:
                w.grad = None
    finally:
        for name, fn in originals.items():
            setattr(T, name, fn)
    split = {name: statistics.median(p.get(name, 0.0) for p in parts) * 1e3 for name in SPLIT}
    res = {"op_fwd_host_ms": statistics.median(fwd), "op_bwd_host_ms": statistics.median(bwd),
           "op_fwd_split_ms": split}  # fmt: skip
    res["op_fwd_rest_ms"] = res["op_fwd_host_ms"] - sum(split.values())
    return res


def model_rows(reps: int = 8, layers: int = 4) -> dict:
    """Host ms of the 4-layer model's forward and backward, dense and TwELL FFNs, each with launches
    through Triton's front end and through the kept kernels."""
    from twell.model.config import ModelConfig
    from twell.model.transformer import Transformer
    from twell.training.trainer import apply_block_wrappers

    res = {}
    for impl in ("dense", "twell"):
        cfg = ModelConfig.preset("1.5b", n_layers=layers, ffn_impl=impl)
        torch.manual_seed(0)
        model = Transformer(cfg).cuda()
        apply_block_wrappers(model, activation_checkpointing=False, compile_blocks=True)
        tokens = torch.randint(0, cfg.vocab_size, (8, 2048), device="cuda")
        for setting in SETTINGS:
            use(setting)
            fwd, bwd = [], []
            for i in range(reps + 3):
                with T.deferred_sizes() as sizes:
                    busy()
                    t0 = time.perf_counter()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        out = model(tokens)
                        loss = out.logits.float().mean() + out.l1
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    sizes.settle()
                model.zero_grad(set_to_none=True)
                if i >= 3:
                    fwd.append((t1 - t0) * 1e3)
                    bwd.append((t2 - t1) * 1e3)
            res[f"{impl}_{setting}"] = {
                "fwd_host_ms": statistics.median(fwd), "bwd_host_ms": statistics.median(bwd),
            }  # fmt: skip
            print(impl, setting, res[f"{impl}_{setting}"], flush=True)
        del model
        torch.cuda.empty_cache()
    return res


def launch_rows(reps: int = 3000) -> dict:
    """Host us a launch of a 3-argument copy kernel: plain, autotuned (one config), each through Triton's
    front end and through fast()."""
    import triton
    import triton.language as tl

    from twell.kernels._launch import fast

    @triton.jit
    def copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    tuned = triton.autotune([triton.Config({"BLOCK": 256}, num_warps=4)], key=["n"])(triton.jit(copy.fn))
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    calls = {
        "jit[grid]": lambda: copy[(16,)](x, y, 4096, BLOCK=256),
        "fast(jit)[grid]": (lambda k: lambda: k[(16,)](x, y, 4096, BLOCK=256))(fast(copy)),
        "autotune[grid]": lambda: tuned[(16,)](x, y, 4096),
        "fast(autotune)[grid]": (lambda k: lambda: k[(16,)](x, y, 4096))(fast(tuned)),
    }
    res = {}
    set_fast_launch(True)
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        res[name] = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
    return res


def main() -> None:
    res = {"launch_us": launch_rows()}
    print(json.dumps(res, indent=1), flush=True)
    for setting in SETTINGS:
        use(setting)
        res[f"op_{setting}"] = op_rows()
        print(setting, json.dumps(res[f"op_{setting}"], indent=1), flush=True)
    res["model"] = model_rows()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
