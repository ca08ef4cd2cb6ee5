"""Re-summarise call 2's profile trace without the GPU-side copies of the phase ranges (gpu_user_annotation),
which the summary of commit 5068097 counted as kernels: they covered the gaps, so it reported 2.96 ms of idle
time a step and 220 ms of "other" kernels.

    python docs/results/2026-12-05-d/resummarize.py step_70.trace.json.gz 3 244.94
"""

import gzip
import json
import sys

from twell.training.profiling import PHASE_PREFIX, format_summary, summarize

path, steps, wall_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
events = json.load(gzip.open(path) if path.endswith(".gz") else open(path))["traceEvents"]
kernels = [
    (e["name"], e["ts"], e["ts"] + e["dur"])
    for e in events
    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
]
phases = [
    (e["name"][len(PHASE_PREFIX) :], e["ts"], e["ts"] + e["dur"])
    for e in events
    if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE_PREFIX)
]
print(format_summary(summarize(kernels, wall_ms * steps / 1e3, steps, phases)))
