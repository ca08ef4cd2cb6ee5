"""GPU probe of 2026-12-07 (calls 3 and 4): why the trainer's backward rarely replayed from the op graphs.

With this folder on PYTHONPATH and TWELL_PROBE=1, Python imports it at start-up (sitecustomize): it wraps
train.py's graphed_forward / graphed_backward / eligible and prints, at exit, why each backward did or did
not find its layer's graph ("found"; "rows_mismatch": row_ptr found a live layer, rows did not match;
"no_ref": no layer graph at that row_ptr), with the first mismatches' pointers and shapes.
"""

import atexit
import collections
import os
import threading

if os.environ.get("TWELL_PROBE"):
    import torch

    from twell.kernels.training import train as T
    from twell.kernels.training import train_graph as G

    reasons = collections.Counter()
    fwd = {}  # row_ptr address -> rows address, of every output of graphed_forward
    orig_forward, orig_backward, orig_eligible = G.graphed_forward, G.graphed_backward, T.eligible

    def graphed_forward(inputs, key, *args, **kwargs):
        out = orig_forward(inputs, key, *args, **kwargs)
        if out is not None:
            fwd[out[5].data_ptr()] = out[6].data_ptr()
        return out

    def graphed_backward(args, impl):
        rp, rows = args[6].data_ptr(), args[7].data_ptr()
        ref = G._by_row_ptr.get(rp)
        layer = ref() if ref is not None else None
        if ref is None:
            reason = "no_ref" + ("_but_graphed_fwd" if rp in fwd else "")
        elif layer is None:
            reason = "dead_ref"
        elif layer.outputs[6].data_ptr() != rows:
            reason = "rows_mismatch"
            if reasons[reason] < 6:
                o6, a7 = layer.outputs[6], args[7]
                print(
                    "PROBE_MM", rp, rows, a7.shape, a7.dtype, a7.storage_offset(), a7.untyped_storage().data_ptr(),
                    "L", layer.outputs[5].data_ptr(), o6.data_ptr(), o6.shape, o6.untyped_storage().data_ptr(),
                    "cap", layer.capacity, "fwd", fwd.get(rp), "diff", rows - o6.data_ptr(),
                    [t.shape for t in args[6:12]], flush=True,
                )  # fmt: skip
        else:
            reason = "found"
        reasons[reason] += 1
        reasons[
            "thread_" + ("main" if threading.current_thread() is threading.main_thread() else "other")
        ] += 1
        return orig_backward(args, impl)

    def eligible(x):
        ok = orig_eligible(x)
        if not ok:
            capturing = int(torch.cuda.is_current_stream_capturing())
            reasons[f"not_eligible_cap{capturing}_on{int(G.graphs_enabled())}"] += 1
        return ok

    T.graphed_forward, T.graphed_backward, T.eligible = graphed_forward, graphed_backward, eligible
    atexit.register(lambda: print("PROBE", dict(reasons), G.graph_stats(), flush=True))
