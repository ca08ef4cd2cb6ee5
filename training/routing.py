"""Routing of `model.ffn_impl=auto` by measured break-even: the activity below which the TwELL training FFN
beats the dense one on this GPU, at this run's shape.

A layer of an "auto" model takes the sparse path while its mean active units per token is below
`model.twell_threshold` (default 50). With `model.twell_threshold=auto` (opt-in) the trainer takes that number from
here at start: the FFN's training step (forward with its L1 term and statistics, backward), as the trainer
runs it (`ReLUGatedFFN` under the run's autocast dtype, compiled when the blocks are), is timed dense and
TwELL on paper-like inputs (kernels.synthetic) at a ladder of mean active units per token, and the
break-even is interpolated between the rungs (`break_even`). The result is cached per GPU in
`routing.json` under $TWELL_CACHE (default ~/.cache/twell), keyed by the GPU's name, the shape (d_model,
d_ff, tokens per micro-batch), the dtype, the hot units, compilation and the torch and triton versions; a
later run loads it instead of measuring. A CPU run (or one where the measurement fails) routes at
`TWELL_THRESHOLD_FALLBACK` (50) unless the cache holds its key.

Why it is not the default: the layer timed alone is host-bound at 16k tokens (the eager TwELL op's host
time exceeds its GPU time), while inside a model that host time overlaps the GPU's attention work. On an
H200 (paper_0.5b start, compiled, 2026-12-04) TwELL measured 1.03-1.27x slower than compiled dense at
every rung from 8 to 258 active units, so `auto` routed nothing sparse, where the same layers with the
threshold 50 make the 1.5b trainer 28.5% faster. The measurement must time a layer's GPU cost in the
model before `auto` can be the default.

Print the table of a shape on a GPU (and store it in the cache):

    python -m twell.training.routing --d-model 2048 --d-ff 5632 --tokens 16384 [--compile] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from twell.model.config import TWELL_THRESHOLD_FALLBACK, ModelConfig
from twell.model.ffn import ReLUGatedFFN, kernels_usable

log = logging.getLogger(__name__)

LADDER = (8, 16, 32, 64, 128, 256, 512)  # mean active units per token of the timed inputs
DEAD_FRACTION = 0.3  # of the synthetic inputs' units (their default): a rung must stay below live units / 2
CACHE_VERSION = 1
CACHE_NAME = "routing.json"
KEY_FIELDS = ("device", "d_model", "d_ff", "tokens", "dtype", "hot_units", "compiled", "torch", "triton")
DTYPES = ("bf16", "fp32")


def break_even(active: list[float], dense_ms: list[float], twell_ms: list[float]) -> float:
    """The activity below which TwELL is faster, from times at increasing activities: between the highest
    rung where TwELL is faster and the next one, where their difference (close to linear in the activity:
    TwELL's work grows with the active units, dense's does not) crosses zero. TwELL faster at every rung:
    the top rung; at none: 0 (never sparse)."""
    if not active or not len(active) == len(dense_ms) == len(twell_ms):
        raise ValueError(
            f"break_even needs one dense and one TwELL time per rung: got {len(active)} rungs, "
            f"{len(dense_ms)} dense and {len(twell_ms)} TwELL times"
        )
    if any(high <= low for low, high in zip(active, active[1:])):
        raise ValueError(f"the rungs' activities must increase, got {list(active)}")
    gain = [dense - twell for dense, twell in zip(dense_ms, twell_ms)]  # > 0: TwELL is faster
    faster = [i for i, g in enumerate(gain) if g > 0]
    if not faster:
        return 0.0
    i = faster[-1]
    if i == len(active) - 1:
        return float(active[-1])
    return active[i] + (active[i + 1] - active[i]) * gain[i] / (gain[i] - gain[i + 1])


@dataclass
class BreakEven:
    """A measured table: the key it holds for, per rung the measured mean active units per token and the
    median ms of a dense and a TwELL training step, and the break-even threshold."""

    key: dict
    active: list[float]
    dense_ms: list[float]
    twell_ms: list[float]
    threshold: float
    measured_at: str = ""

    def to_dict(self) -> dict:
        return {
            **self.key,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "key"},
        }

    @classmethod
    def from_dict(cls, entry: dict) -> BreakEven:
        """A cache entry as a table; ValueError when a field is missing or of the wrong kind."""
        lists = {name: entry.get(name) for name in ("active", "dense_ms", "twell_ms")}
        for name, values in lists.items():
            if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
                raise ValueError(f"{name} must be a list of numbers, got {values!r}")
        threshold = entry.get("threshold")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
        key = {name: entry[name] for name in KEY_FIELDS}
        return cls(key, **lists, threshold=float(threshold), measured_at=str(entry.get("measured_at", "")))

    def table(self) -> str:
        lines = [f"  {'active/token':>12} {'dense ms':>9} {'TwELL ms':>9} {'TwELL/dense':>11}"]
        for active, dense, twell in zip(self.active, self.dense_ms, self.twell_ms):
            lines.append(f"  {active:12.1f} {dense:9.3f} {twell:9.3f} {twell / dense:11.2f}")
        return "\n".join(lines)


@dataclass
class ThresholdChoice:
    """The threshold a run routes by and where it came from: "config" (a number in model.twell_threshold),
    "measured", "loaded" (from the cache) or "fallback" (nothing measured; `reason` says why)."""

    threshold: float
    source: str
    table: BreakEven | None = None
    cache: str = ""
    reason: str = ""

    def describe(self) -> str:
        head = f"FFN routing: a layer goes sparse below {self.threshold:.1f} active units/token"
        if self.source == "config":
            return f"{head} (model.twell_threshold={self.threshold:g})"
        if self.source == "fallback":
            return f"{head} (model.twell_threshold=auto, the fallback: {self.reason})"
        key = self.table.key
        where = (
            f"{key['device']}, d_model {key['d_model']}, d_ff {key['d_ff']}, {key['tokens']} tokens, "
            f"{key['dtype']}, {key['hot_units']} hot units, {'compiled' if key['compiled'] else 'eager'}"
        )
        verb = "measured" if self.source == "measured" else f"loaded from {self.cache} (measured"
        when = "" if self.source == "measured" else f", {self.table.measured_at})"
        return f"{head}, the break-even {verb} on {where}{when}:\n{self.table.table()}"

    def record(self) -> dict:
        """The fields a run logs once (JSONL record, wandb config)."""
        out = {"twell_threshold": self.threshold, "twell_threshold_source": self.source}
        if self.table is not None:
            out["twell_break_even"] = {
                "active": self.table.active, "dense_ms": self.table.dense_ms, "twell_ms": self.table.twell_ms,
            }  # fmt: skip
        return out


# ------------------------------------------------------------------ the cache


def cache_path() -> Path:
    """$TWELL_CACHE/routing.json, else $XDG_CACHE_HOME/twell/routing.json (default ~/.cache)."""
    folder = os.environ.get("TWELL_CACHE")
    if folder:
        return Path(folder) / CACHE_NAME
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "twell" / CACHE_NAME


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def routing_key(
    device: torch.device,
    d_model: int,
    d_ff: int,
    tokens: int,
    dtype: str,
    hot_units: int | None,
    compiled: bool,
) -> dict:
    """What a break-even depends on. hot_units: the setting (None: the kernels' default), resolved here
    to the number a call of `tokens` rows takes."""
    from twell.kernels.training.train import hot_units_for

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - depends on the installation
        triton_version = "none"
    return {
        "device": device_name(device), "d_model": d_model, "d_ff": d_ff, "tokens": tokens, "dtype": dtype,
        "hot_units": hot_units_for(tokens, d_ff, hot_units), "compiled": bool(compiled),
        "torch": torch.__version__, "triton": triton_version,
    }  # fmt: skip


def read_cache(path: Path) -> list[dict]:
    """The cache's entries; a missing file is empty, an unreadable or unknown one is ignored with a warning."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError(f"not a routing table of version {CACHE_VERSION}")
        entries = data.get("entries")
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("its 'entries' is not a list of tables")
        return entries
    except (OSError, UnicodeDecodeError, ValueError) as err:
        log.warning("ignoring the routing cache %s (%s); a new measurement replaces it", path, err)
        return []


def load_cached(path: Path, key: dict) -> BreakEven | None:
    """The cached table of `key`, or None (no file, no entry, or a broken one: warned)."""
    for entry in read_cache(path):
        if all(entry.get(name) == value for name, value in key.items()):
            try:
                return BreakEven.from_dict(entry)
            except (KeyError, ValueError) as err:
                log.warning("ignoring a broken entry of the routing cache %s (%s)", path, err)
                return None
    return None


def store(path: Path, table: BreakEven) -> None:
    """Add (or replace) the table's entry; an unwritable cache only warns."""
    entries = [e for e in read_cache(path) if any(e.get(k) != v for k, v in table.key.items())]
    entries.append(table.to_dict())
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=1) + "\n")
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as err:
        log.warning("could not write the routing cache %s (%s); the next run measures again", path, err)


# ------------------------------------------------------------------ the measurement


def _median_ms(step, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _training_step(forward, ffn: ReLUGatedFFN, x: torch.Tensor, autocast, grads: tuple) -> None:
    """One FFN step as a block of the trainer runs it: forward under autocast with L1 and statistics,
    backward to x and the weights (gradients set anew, as each optimizer step does)."""
    x.grad = None
    ffn.zero_grad(set_to_none=True)
    with autocast:
        y, l1, _ = forward(x, with_stats=True)
    torch.autograd.backward([y, l1], list(grads))


def measure_break_even(
    d_model: int,
    d_ff: int,
    tokens: int,
    device: torch.device | str,
    *,
    dtype: str = "bf16",
    hot_units: int | None = None,
    compiled: bool = False,
    ladder: tuple[float, ...] = LADDER,
    iters: int = 10,
    warmup: int = 2,
    seed: int = 0,
) -> BreakEven:
    """Time one FFN training step (fp32 weights, forward under `dtype` autocast with L1 and statistics,
    backward to x and the weights) dense and TwELL at each rung of `ladder` (median of `iters` after
    `warmup`; compiled: the FFN's forward through torch.compile, as a compiled block runs it). Run it after
    kernels.train.warm_up, which tunes the kernels: an untuned kernel tunes in the warm-up calls here."""
    from twell.kernels.synthetic import paper_like_ffn_inputs

    device = torch.device(device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    rungs = [a for a in ladder if 0 < a < d_ff * (1 - DEAD_FRACTION) / 2]
    if not rungs:
        raise ValueError(f"no rung of {ladder} fits d_ff={d_ff} (each must be in (0, {d_ff * 0.35:g}))")
    probe = torch.empty(0, device=device)
    if not kernels_usable(probe):
        raise RuntimeError(
            f"the TwELL kernels do not run on {device} (a GPU, or TRITON_INTERPRET=1 on a CPU)"
        )
    ffn = ReLUGatedFFN(d_model, d_ff, impl="auto", hot_units=hot_units).to(device)
    forward = ffn.forward
    if compiled:
        from twell.training.trainer import configure_compile

        configure_compile()
        forward = torch.compile(ffn.forward)  # its own code object: the blocks' compiled frames are untouched
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    autocast = torch.autocast(device.type, dtype=low) if dtype == "bf16" else contextlib.nullcontext()
    gen = torch.Generator(device=device).manual_seed(seed)
    grad_y = torch.randn(tokens, d_model, generator=gen, device=device).to(low)
    grad_l1 = torch.ones((), device=device)
    active, dense_ms, twell_ms = [], [], []
    for rung in rungs:
        x, *weights = paper_like_ffn_inputs(
            tokens, d_model, d_ff, mean_active=rung, dead_fraction=DEAD_FRACTION, dtype=torch.float32,
            device=device, seed=seed,
        )  # fmt: skip
        with torch.no_grad():
            for param, weight in zip((ffn.w_gate, ffn.w_up, ffn.w_down), weights):
                param.copy_(weight)
        x.requires_grad_()
        step = functools.partial(_training_step, forward, ffn, x, autocast, (grad_y, grad_l1))
        for sparse, times in ((False, dense_ms), (True, twell_ms)):
            ffn.set_sparse(sparse)
            times.append(_median_ms(step, device, warmup, iters))
        ffn.set_sparse(False)
        with torch.no_grad(), autocast:
            active.append(float(ffn(x)[2].active_mean))
    del ffn, forward
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    key = routing_key(device, d_model, d_ff, tokens, dtype, hot_units, compiled)
    return BreakEven(
        key, active, dense_ms, twell_ms, break_even(active, dense_ms, twell_ms),
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
    )  # fmt: skip


# ------------------------------------------------------------------ the trainer's choice


def choose_threshold(
    mcfg: ModelConfig, tokens: int, device: torch.device, *, precision: str, compiled: bool
) -> ThresholdChoice:
    """The threshold an "auto" FFN routes by: model.twell_threshold when it is a number; for "auto" the
    cached break-even of this key, else (on a GPU) a fresh measurement, stored in the cache, else the
    fallback. Under torch.distributed every rank routes by rank 0's number (only rank 0 writes the cache)."""
    if mcfg.twell_threshold != "auto":
        return ThresholdChoice(float(mcfg.twell_threshold), "config")
    path = cache_path()
    key = routing_key(device, mcfg.d_model, mcfg.d_ff, tokens, precision, mcfg.twell_hot_units, compiled)
    table = load_cached(path, key)
    if table is not None:
        choice = ThresholdChoice(table.threshold, "loaded", table, cache=str(path))
    elif device.type != "cuda":
        choice = ThresholdChoice(
            TWELL_THRESHOLD_FALLBACK, "fallback", reason=f"no break-even is measured on {device.type}"
        )
    else:
        try:
            table = measure_break_even(
                mcfg.d_model, mcfg.d_ff, tokens, device, dtype=precision, hot_units=mcfg.twell_hot_units,
                compiled=compiled,
            )  # fmt: skip
        except Exception as err:  # a failed measurement costs the run its tuning, never the run itself
            log.warning("the break-even measurement failed (%s: %s)", type(err).__name__, err)
            choice = ThresholdChoice(TWELL_THRESHOLD_FALLBACK, "fallback", reason="the measurement failed")
        else:
            if not dist.is_initialized() or dist.get_rank() == 0:
                store(path, table)
            choice = ThresholdChoice(table.threshold, "measured", table, cache=str(path))
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([choice.threshold], dtype=torch.float64, device=device)
        dist.broadcast(value, src=0)
        choice.threshold = float(value.item())
    return choice


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> BreakEven:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--d-ff", type=int, default=5632)
    parser.add_argument(
        "--tokens", type=int, default=16384, help="tokens per micro-batch (micro_batch * seq_len)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="the trainer's precision")
    parser.add_argument(
        "--hot-units", type=int, default=None, help="model.twell_hot_units (default: the kernels')"
    )
    parser.add_argument(
        "--compile", action="store_true", help="time the FFN through torch.compile (train.compile)"
    )
    parser.add_argument(
        "--ladder", type=float, nargs="+", default=list(LADDER), help="mean active units per token"
    )
    parser.add_argument("--iters", type=int, default=10, help="timed steps per rung and path (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="also write <out>/break_even.json")
    parser.add_argument("--no-cache", action="store_true", help=f"do not store the table in {cache_path()}")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        from twell.kernels.training.train import warm_up

        print(f"warming the TwELL kernels up at {args.tokens} tokens ...", flush=True)
        warm_up(args.tokens, args.d_model, args.d_ff, device, hot_units=args.hot_units)
    start = time.perf_counter()
    table = measure_break_even(
        args.d_model, args.d_ff, args.tokens, device, dtype=args.dtype, hot_units=args.hot_units,
        compiled=args.compile, ladder=tuple(args.ladder), iters=args.iters, warmup=args.warmup,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    path = cache_path()
    if not args.no_cache:
        store(path, table)
    print(ThresholdChoice(table.threshold, "measured", table, cache=str(path)).describe())
    print(f"measured in {seconds:.1f} s" + ("" if args.no_cache else f"; stored in {path}"))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {**table.to_dict(), "seconds": seconds}
        (args.out / "break_even.json").write_text(json.dumps(result, indent=1) + "\n")
    return table


if __name__ == "__main__":
    main()
