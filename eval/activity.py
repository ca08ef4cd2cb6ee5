"""Activity of a checkpoint's FFNs on given text: per layer and per token position.

PAPER.md ("The sparsity loss"): the first layers and the first tokens of each sequence are the most
active, and the per-layer maximum per token exceeds the mean by more than 10x. This module measures
exactly that on any input, and can dump one layer's FFN inputs and weights for scripts/bench_ffn.py.

Every number comes from the model's own FFN code (dense or TwELL, whichever the layer runs):
per-layer figures from the forward's `ActivityStats`, per-position figures from a forward hook on
each FFN module that runs that same module again on the tokens of each position bucket. "Active" is
the contract's definition: gate pre-activation > 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BENCH_KEYS = ("x", "w_gate", "w_up", "w_down")  # what scripts/bench_ffn.py --activations reads


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    """[lo, hi) position ranges 0, 1, 2-3, 4-7, ... with the last one cut at seq_len."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    buckets, lo = [(0, 1)], 1
    while lo < seq_len:
        buckets.append((lo, min(2 * lo, seq_len)))
        lo *= 2
    return buckets


def bucket_label(lo: int, hi: int) -> str:
    return str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}"


@dataclass
class ActivityReport:
    d_ff: int
    tokens: int
    sequences: int
    active_mean: list[float]  # [L] mean active units per token
    active_max: list[int]  # [L] most active units of any token
    active_frac: list[float]  # [L] active_mean / d_ff
    never_fired: list[int]  # [L] units that fired on no token of this text
    buckets: list[tuple[int, int]]  # position ranges [lo, hi)
    bucket_tokens: list[int]  # [P] tokens seen in each range (over all sequences)
    position_mean: list[list[float | None]]  # [L][P] mean active units per token in each range

    @property
    def n_layers(self) -> int:
        return len(self.active_mean)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["buckets"] = [bucket_label(lo, hi) for lo, hi in self.buckets]
        out["bucket_ranges"] = [list(b) for b in self.buckets]
        out["never_fired_frac"] = [n / self.d_ff for n in self.never_fired]
        return out

    def table(self) -> str:
        """Per-layer rows, then one row per layer of mean active units by position bucket."""
        lines = [
            f"{self.tokens} tokens in {self.sequences} sequences, d_ff {self.d_ff}",
            f"{'layer':>5} {'mean':>9} {'max':>6} {'active %':>9} {'never fired':>12} {'(% of d_ff)':>11}",
        ]
        for i in range(self.n_layers):
            lines.append(
                f"{i:>5} {self.active_mean[i]:9.2f} {self.active_max[i]:>6} {100 * self.active_frac[i]:8.3f}% "
                f"{self.never_fired[i]:>12} {100 * self.never_fired[i] / self.d_ff:10.2f}%"
            )
        labels = [bucket_label(lo, hi) for lo, hi in self.buckets]
        width = max(8, *(len(s) + 1 for s in labels))
        lines.append("mean active units per token by position:")
        lines.append(f"{'layer':>5} " + "".join(f"{s:>{width}}" for s in labels))
        lines.append(f"{'tok':>5} " + "".join(f"{n:>{width}}" for n in self.bucket_tokens))
        for i, row in enumerate(self.position_mean):
            cells = "".join(f"{'-':>{width}}" if v is None else f"{v:>{width}.2f}" for v in row)
            lines.append(f"{i:>5} {cells}")
        return "\n".join(lines)

    def save_json(self, path: str | Path, **meta) -> Path:
        """The report as JSON; `meta` (e.g. checkpoint=<the step read>) is recorded beside it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**meta, **self.to_dict()}, indent=1))
        return path


class _LayerTally:
    """Running totals for one layer; integer counts so that means are exact whatever the token count."""

    def __init__(self, d_ff: int, n_buckets: int):
        self.active_pairs = 0
        self.active_max = 0
        self.unit_fires = torch.zeros(d_ff, dtype=torch.int64)
        self.bucket_pairs = [0] * n_buckets


class ActivityMeter:
    """Forward hooks on every layer's FFN that tally activity per position bucket over many forwards.

    With `capture_layers`, it also keeps those layers' FFN inputs x (flattened to [tokens, d_model])
    and outputs y (same shape), in the order the forwards ran.
    """

    def __init__(self, net, seq_len: int, capture_layers: Iterable[int] = ()):
        self.net = net
        self.buckets = position_buckets(seq_len)
        self.d_ff = net.cfg.d_ff
        self.tallies = [_LayerTally(self.d_ff, len(self.buckets)) for _ in net.layers]
        self.bucket_tokens = [0] * len(self.buckets)
        self.tokens = self.sequences = 0
        self.capture_layers = sorted(set(capture_layers))
        self.captured = {i: {"x": [], "y": []} for i in self.capture_layers}
        self._handles = []

    def __enter__(self) -> ActivityMeter:
        for i, block in enumerate(self.net.layers):
            self._handles.append(block.ffn.register_forward_hook(self._make_hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, layer: int):
        def hook(module, args, output):
            x = args[0]
            tally = self.tallies[layer]
            seq_len = x.shape[1]
            pairs = []
            for lo, hi in self.buckets:
                if lo >= seq_len:
                    break
                # module.forward (not module(...)) runs the same FFN code without re-entering hooks.
                _, _, stats = module.forward(x[:, lo:hi], with_stats=True)
                pairs.append(stats.unit_fires.sum(dtype=torch.int64))
            # One device-to-host read per layer, not one per bucket.
            for b, n in enumerate(torch.stack(pairs).tolist()):
                tally.bucket_pairs[b] += n
            if layer in self.captured:
                self.captured[layer]["x"].append(x.detach().reshape(-1, x.shape[-1]).cpu())
                self.captured[layer]["y"].append(output[0].detach().reshape(-1, x.shape[-1]).cpu())

        return hook

    @torch.no_grad()
    def run(self, tokens: torch.Tensor) -> None:
        """One forward of tokens [B, S] with statistics; per-layer figures from its ActivityStats."""
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must be [batch, seq_len >= 1], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.buckets[-1][1]:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the meter's seq_len {self.buckets[-1][1]}"
            )
        vocab = self.net.cfg.vocab_size
        if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
            raise ValueError(
                f"token ids span [{int(tokens.min())}, {int(tokens.max())}] but the model's vocab_size is "
                f"{vocab}: the tokenizer does not match the checkpoint (pass tokenizer=<the run's tokenizer>)"
            )
        device = next(self.net.parameters()).device
        tokens = tokens.to(device)
        # bf16 autocast on GPU, as in training and validation: activity depends on the precision.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            stats = self.net(tokens, with_stats=True).stats
        fires = stats.unit_fires.to(torch.int64).cpu()
        active_max = stats.active_max.cpu().tolist()
        for tally, layer_fires, layer_max in zip(self.tallies, fires, active_max):
            tally.active_pairs += int(layer_fires.sum())  # = sum over tokens of active units, exactly
            tally.active_max = max(tally.active_max, int(layer_max))
            tally.unit_fires += layer_fires
        batch, seq_len = tokens.shape
        for b, (lo, hi) in enumerate(self.buckets):
            self.bucket_tokens[b] += batch * max(0, min(hi, seq_len) - lo)
        self.tokens += tokens.numel()
        self.sequences += batch

    def report(self) -> ActivityReport:
        if self.tokens == 0:
            raise ValueError("no tokens were measured: the input text or data produced no tokens")
        active_mean = [t.active_pairs / self.tokens for t in self.tallies]
        position_mean = [
            [pairs / n if n else None for pairs, n in zip(t.bucket_pairs, self.bucket_tokens)]
            for t in self.tallies
        ]
        return ActivityReport(
            d_ff=self.d_ff,
            tokens=self.tokens,
            sequences=self.sequences,
            active_mean=active_mean,
            active_max=[t.active_max for t in self.tallies],
            active_frac=[m / self.d_ff for m in active_mean],
            never_fired=[int((t.unit_fires == 0).sum()) for t in self.tallies],
            buckets=list(self.buckets),
            bucket_tokens=list(self.bucket_tokens),
            position_mean=position_mean,
        )


def batches_of(sequences: list[list[int]], batch_size: int) -> Iterator[torch.Tensor]:
    """int64 [B, S] batches of equal-length sequences (no padding, so no masking of statistics)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    by_length: dict[int, list[list[int]]] = {}
    for seq in sequences:
        by_length.setdefault(len(seq), []).append(seq)
    for length in sorted(by_length, reverse=True):
        group = by_length[length]
        for start in range(0, len(group), batch_size):
            yield torch.tensor(group[start : start + batch_size], dtype=torch.int64)


def text_sequences(tokenizer, text: str, seq_len: int) -> list[list[int]]:
    """The text's tokens (no special tokens, as training packs documents) cut into seq_len pieces.

    Each piece is its own sequence starting at position 0, like a row of training data.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the text is empty (it produced no tokens): pass --text '...' or a non-empty --file")
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]


def validation_rows(data_cfg, tokenizer, seq_len: int, rows: int, batch_size: int) -> Iterator[torch.Tensor]:
    """The first `rows` rows of the configured held-out data, packed as training sees them."""
    from twell.data import build_val_stream

    if rows < 1:
        raise ValueError(f"--val-rows={rows} must be >= 1")
    batch_size = min(batch_size, rows)
    batches = build_val_stream(
        data_cfg,
        tokenizer,
        seq_len=seq_len,
        micro_batch=batch_size,
        rank=0,
        world_size=1,
        num_batches=math.ceil(rows / batch_size),
    )
    left = rows
    for batch in batches:
        yield batch["input_ids"][:left]
        left -= batch_size


def parse_layers(spec: str | int | None, n_layers: int) -> list[int]:
    """'all' -> every layer; '3' or '0,5' -> those layers (negative counts from the end)."""
    if spec is None:
        return []
    if str(spec).strip().lower() == "all":
        return list(range(n_layers))
    layers = []
    for word in str(spec).split(","):
        try:
            index = int(word)
        except ValueError:
            raise ValueError(
                f"layer {word!r} is not an integer; use e.g. --layer 3 or --layers all"
            ) from None
        if not -n_layers <= index < n_layers:
            raise ValueError(
                f"layer {index} is out of range: the model has {n_layers} layers (valid: 0..{n_layers - 1}, "
                "or negative from the end)"
            )
        layers.append(index % n_layers)
    return sorted(set(layers))


def dump_paths(path: str | Path, layers: list[int]) -> dict[int, Path]:
    """One file per layer: `path` itself for one layer, `<stem>.layerNN<suffix>` for several."""
    path = Path(path)
    if len(layers) == 1:
        return {layers[0]: path}
    suffix = path.suffix or ".pt"
    return {i: path.with_name(f"{path.stem}.layer{i:02d}{suffix}") for i in layers}


@torch.no_grad()
def dump_ffn_inputs(
    meter: ActivityMeter, path: str | Path, dtype: torch.dtype | None = None
) -> dict[int, Path]:
    """Write each captured layer's FFN input x [tokens, d_model] and its weights [d_ff, d_model].

    Keys x, w_gate, w_up, w_down are what `scripts/bench_ffn.py --activations` reads (w_down
    neuron-major, as the model stores it); `layer` and `tokens` say where it came from. dtype None
    keeps the model's dtype (x as the FFN saw it), e.g. torch.bfloat16 halves the file.
    """
    if not meter.capture_layers:
        raise ValueError("the meter captured no layers: build it with capture_layers=[...]")
    written = {}
    for layer, out in dump_paths(path, meter.capture_layers).items():
        captured = meter.captured[layer]["x"]
        if not captured:
            raise ValueError(f"layer {layer} captured no inputs: run the meter on some tokens first")
        ffn = meter.net.layers[layer].ffn
        x = torch.cat(captured)
        blob = {"x": x, "w_gate": ffn.w_gate, "w_up": ffn.w_up, "w_down": ffn.w_down}
        blob = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in blob.items()}
        blob.update(layer=layer, tokens=x.shape[0])
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(blob, out)
        written[layer] = out
    return written


def plot_report(report: ActivityReport, path: str | Path, title: str = "") -> Path:
    """Per-layer bars (mean, max), per-position lines (one per layer) and a layer x position heatmap."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works on machines without a display
    import matplotlib.pyplot as plt
    import numpy as np

    layers = np.arange(report.n_layers)
    labels = [bucket_label(lo, hi) for lo, hi in report.buckets]
    grid = np.array([[np.nan if v is None else v for v in row] for row in report.position_mean], dtype=float)
    seen = ~np.all(np.isnan(grid), axis=0)  # drop buckets no sequence reached
    grid, labels = grid[:, seen], [s for s, keep in zip(labels, seen) if keep]

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    ax = axes[0]
    ax.bar(layers - 0.2, report.active_mean, width=0.4, label="mean")
    ax.bar(layers + 0.2, report.active_max, width=0.4, label="max")
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)  # log bars grow from here, so a layer with mean < 1 still shows
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("active hidden units per token")
    ax.set_title(f"per layer (d_ff {report.d_ff})")
    ax.legend()

    ax = axes[1]
    colors = plt.cm.viridis(np.linspace(0, 1, max(report.n_layers, 2)))
    for i in layers:
        ax.plot(range(len(labels)), grid[i], marker="o", ms=3, color=colors[i], label=f"layer {i}")
    ax.set_xticks(range(len(labels)), labels, rotation=45)
    ax.set_yscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("mean active units per token")
    ax.set_title("per position")
    if report.n_layers <= 12:
        ax.legend(fontsize=7)

    ax = axes[2]
    image = ax.imshow(np.log10(np.maximum(grid, 1e-1)), aspect="auto", cmap="magma", origin="lower")
    ax.set_xticks(range(len(labels)), labels, rotation=45)
    ax.set_yticks(layers)
    ax.set_xlabel("token position")
    ax.set_ylabel("layer")
    ax.set_title("log10 mean active units")
    fig.colorbar(image, ax=ax)
    fig.suptitle(title or f"FFN activity on {report.tokens} tokens")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
