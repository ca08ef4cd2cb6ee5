"""Session 18 call 4: side stream x fused hot GEMM epilogues, then the hot-unit count."""

import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import twell.kernels.train as kt  # noqa: E402
from scripts.bench_train import _twell_y_l1, graphed_step, prepare_step  # noqa: E402
from twell.kernels.synthetic import paper_like_ffn_inputs  # noqa: E402

kt.set_hot_units(1024)
kt.set_backward_variant("fused3")
inputs = paper_like_ffn_inputs(16384, 2048, 5632, device="cuda", dtype=torch.bfloat16, seed=16384 + 5632)
leaves, grad_y, ref = prepare_step(inputs)
orig_on = kt._on
state = {"carve": 0}


@contextlib.contextmanager
def on_carved(side, after=None):
    with orig_on(side, after):
        if side is not None and state["carve"]:
            old = torch._C._get_sm_carveout_experimental()
            torch._C._set_sm_carveout_experimental(state["carve"])
            try:
                yield
            finally:
                torch._C._set_sm_carveout_experimental(old)
        else:
            yield


kt._on = on_carved
dev = torch.cuda.current_device()
configs = [
    ("one_stream_cublas", dict(streams=False, fused=False)),
    ("side_cublas", dict(fused=False)),
    ("side_fused", dict()),
    ("one_stream_fused", dict(streams=False)),
]
rows = []


def run(name, c, rnd, hot=1024):
    kt.set_streams(c.get("streams", True))
    kt._settings["fused_hot"] = c.get("fused", True)
    kt.set_hot_units(hot)
    r = graphed_step(_twell_y_l1, leaves, grad_y, ref, 100, twell=True)
    r = {"config": name, "round": rnd, "hot": hot, **r}
    rows.append(r)
    errs = max(v for k, v in r.items() if k.startswith("graph_err_"))
    ms = r["graph_fwd_bwd_ms"]
    print(
        f"{rnd} {name:20s} hot {hot:5d} {ms:.3f} ms  max err {errs:.1e} misses {r['graph_misses']}",
        flush=True,
    )


for rnd in range(3):
    for name, c in configs:
        run(name, c, rnd)
for rnd in range(2):
    for hot in (768, 896, 1024, 1280):
        run("side_fused", {}, rnd, hot)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "exp2.json"), "w"), indent=1)
