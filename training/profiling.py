"""Where a training step's time goes: torch.profiler over a few optimizer steps of the real run.

`logging.profile_at=N` profiles steps N+1 .. N+logging.profile_steps (the optimizer steps that follow
step N) and writes, under <run_dir>/profile/ (rank 0; other ranks as rank<r>_*):
  step_<N>.trace.json  the Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev)
  step_<N>.txt         the summary below, then the kernels by GPU time
The summary splits the GPU's busy time by kind of kernel (GEMMs, attention, TwELL's Triton kernels,
Inductor's fused kernels, optimizer, communication, other) and names the idle time: wall time per step
minus the time some kernel was running. Idle time is the host's share (launch overhead, host syncs,
data): a step whose GPU is busy 98% of its wall time is bound by its kernels, one busy 70% by the host.
The idle time is also split by what the host was doing meanwhile: the trainer marks its phases (data,
forward, backward, settle: the TwELL entry counts' one host sync, optimizer, sparsity: statistics,
re-initialisation and routing) with record_function ranges named "twell/<phase>", and each gap between
kernels is charged to the phase the host was in (a forward that idles the GPU is host-bound there; idle
time in "settle" is the GPU draining before the sync returns, then the host's restart). The same figures
go to the run's JSONL / wandb as one record (kind "profile").
"""

from __future__ import annotations

import bisect
import contextlib
import re
import time
from pathlib import Path

import torch

# The trainer's phases, as record_function ranges "twell/<phase>" (phase()).
PHASES = ("data", "forward", "backward", "settle", "optimizer", "sparsity")
PHASE_PREFIX = "twell/"


def phase(name: str):
    """A range of the step for the profile's idle-time split (a no-op unless a profiler records)."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; one of {PHASES}")
    if not getattr(torch.autograd.profiler, "_is_profiler_enabled", True):  # (cheaper than an empty range)
        return contextlib.nullcontext()
    return torch.profiler.record_function(PHASE_PREFIX + name)


# Kernel name -> kind, first match wins. Inductor names its generated Triton kernels triton_*; the
# TwELL kernels (kernels/) are Triton kernels named _*_kernel.
KERNEL_KINDS = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|sm\d+_.*(tn|nt|nn|tt)", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("inductor", re.compile(r"^triton_")),
    ("twell", re.compile(r"^_\w+_kernel$")),
)
KINDS = tuple(kind for kind, _ in KERNEL_KINDS) + ("other",)


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel from its name (KERNEL_KINDS); "other" for copies, reductions, etc."""
    for kind, pattern in KERNEL_KINDS:
        if pattern.search(name):
            return kind
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us): the time at least one kernel ran (kernels of
    several streams overlap)."""
    return sum(stop - start for start, stop in _union(intervals))


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(a, b) for a, b in merged]


def _uncovered_merged(ranges, cover, cover_ends) -> float:
    """uncovered_us for sorted, disjoint ranges and cover (cover_ends: the cover's ends, for bisection):
    O(log len(cover)) a range plus the cover intervals it meets."""
    total = 0.0
    for start, stop in ranges:
        cursor, j = start, bisect.bisect_right(cover_ends, start)
        while j < len(cover) and cover[j][0] < stop:
            if cover[j][0] > cursor:
                total += cover[j][0] - cursor
            cursor = max(cursor, cover[j][1])
            j += 1
        if cursor < stop:
            total += stop - cursor
    return total


def uncovered_us(ranges, covered) -> float:
    """Length of the union of `ranges` minus the union of `covered` (us): the time inside the ranges
    that no covered interval (a kernel) spans."""
    cover = _union(covered)
    return _uncovered_merged(_union(ranges), cover, [end for _, end in cover])


def summarize(
    kernels: list[tuple[str, float, float]], wall_s: float, steps: int, phases=()
) -> dict:  # fmt: skip
    """kernels: (name, start us, end us) of every GPU kernel of `steps` steps that took wall_s seconds;
    phases: (phase, start us, end us) of the host's phase ranges on the same clock. Returns per-step
    figures: wall, GPU busy, idle, the busy share, GPU time (ms) by kind and GPU idle time (ms) by the
    host's phase (nested ranges charged to the inner phase; idle outside every phase is not listed)."""
    per_step = 1e3 / steps
    by_kind = dict.fromkeys(KINDS, 0.0)
    for name, start, end in kernels:
        by_kind[kernel_kind(name)] += end - start
    # The kernels merged once: busy time and the idle split both read it (a 1M-token step holds ~10^5
    # kernels, a profile ~10^3 phase ranges).
    cover = _union((s, e) for _, s, e in kernels)
    busy = sum(stop - start for start, stop in cover)
    wall_ms = wall_s * per_step
    idle_by_phase = {}
    if kernels:
        # An inner phase (nested in another's range) takes its share from the outer one: shortest first.
        ends = [end for _, end in cover]
        claimed: list[tuple[float, float]] = []
        for name, start, end in sorted(phases, key=lambda p: p[2] - p[1]):
            inner = _union((max(a, start), min(b, end)) for a, b in claimed if a < end and b > start)
            idle = _uncovered_merged([(start, end)], cover, ends) - _uncovered_merged(inner, cover, ends)
            idle_by_phase[name] = idle_by_phase.get(name, 0.0) + idle
            claimed.append((start, end))
    return {
        "steps": steps,
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy / 1e3 / steps,
        "gpu_idle_ms": max(wall_ms - busy / 1e3 / steps, 0.0),
        "gpu_busy_share": busy / 1e3 / steps / wall_ms if wall_ms > 0 else 0.0,
        "kernels": len(kernels) / steps,
        "gpu_ms_by_kind": {kind: us / 1e3 / steps for kind, us in by_kind.items() if us},
        "gpu_idle_ms_by_phase": {p: idle_by_phase[p] / 1e3 / steps for p in PHASES if p in idle_by_phase},
    }


def format_summary(summary: dict) -> str:
    if not summary["kernels"]:
        return f"{summary['steps']} steps profiled: wall {summary['wall_ms']:.2f} ms/step (no GPU kernels: a CPU run)"
    lines = [
        f"{summary['steps']} steps profiled: wall {summary['wall_ms']:.2f} ms/step, GPU busy "
        f"{summary['gpu_busy_ms']:.2f} ms ({summary['gpu_busy_share']:.1%}), idle {summary['gpu_idle_ms']:.2f} ms, "
        f"{summary['kernels']:.0f} kernels/step",
        "GPU time by kind of kernel (ms/step; kinds overlap where streams run side by side):",
    ]
    for kind, ms in sorted(summary["gpu_ms_by_kind"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<14} {ms:9.2f}")
    idle = summary.get("gpu_idle_ms_by_phase") or {}
    if idle:
        lines.append("GPU idle by what the host was doing (ms/step):")
        for name, ms in idle.items():
            lines.append(f"  {name:<14} {ms:9.2f}")
        rest = summary["gpu_idle_ms"] - sum(idle.values())
        lines.append(f"  {'(no phase)':<14} {max(rest, 0.0):9.2f}")
    return "\n".join(lines)


def split_events(events) -> tuple[list, list]:
    """(kernels, phases) as summarize() takes them, from a profiler's events: every GPU activity (kernels,
    copies, fills) but the GPU-side copies of record_function ranges ("gpu_user_annotation": the phases'
    and the optimizer's ranges seen on the GPU's timeline, which span the kernels launched inside them,
    gaps included), and the host's "twell/<phase>" ranges."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
    ]
    phases = [
        (e.name[len(PHASE_PREFIX) :], e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == cpu and e.name.startswith(PHASE_PREFIX)
    ]
    return kernels, phases


class StepProfiler:
    """Profiles the optimizer steps after step `at` (see the module doc). Call `before_step(step)` before
    each step and `after_step(step)` after it; it starts and stops itself. `at` 0 (or less): off."""

    def __init__(self, at: int, steps: int, out_dir: Path, device: torch.device, prefix: str = ""):
        if steps < 1:
            raise ValueError(f"logging.profile_steps={steps} must be >= 1 (optimizer steps to profile)")
        self.at, self.steps, self.out_dir, self.device, self.prefix = at, steps, Path(out_dir), device, prefix
        self._prof = None
        self._t0 = 0.0
        # seconds of the profiler's own start, stop, event processing and file writing: not training time
        self.overhead_s = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, step: int) -> None:
        if self.at <= 0 or step != self.at or self._prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._sync()
        start = time.perf_counter()
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        self.overhead_s = self._t0 - start

    def after_step(self, step: int) -> dict | None:
        """The summary once the last profiled step is done (files written), else None."""
        if self._prof is None or step < self.at + self.steps:
            return None
        return self._finish(self.steps)

    def close(self, step: int) -> dict | None:
        """At the end of the run: a profile still open (the run stopped, or ended, before its last
        profiled step) is finished over the steps it holds; the summary, or None."""
        if self._prof is None:  # (open only after before_step(at), so step > at here)
            return None
        return self._finish(step - self.at)

    def _finish(self, steps: int) -> dict:
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        kernels, phases = split_events(prof.events())
        summary = summarize(kernels, wall, steps, phases)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"{self.prefix}step_{self.at}"
        prof.export_chrome_trace(str(stem) + ".trace.json")
        sort = "cuda_time_total" if kernels else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=80)
        Path(str(stem) + ".txt").write_text(format_summary(summary) + "\n\n" + table + "\n")
        self.overhead_s += time.perf_counter() - self._t0 - wall
        return summary
