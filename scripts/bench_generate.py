"""Generation speed with the KV cache, dense FFNs against TwELL: decode tokens/s and time to first token.

    python scripts/bench_generate.py --out outputs/bench_generate        # 0.5b and 1.5b, batch 1/8/64, prompt 512, 256 new
    python scripts/bench_generate.py --checkpoint exported/sparselm-1.5b --file held_out.txt --out outputs/bg_trained
    python scripts/bench_generate.py --quick --out /tmp/bench_generate   # CPU smoke test: a small model, interpreter

Per model, FFN implementation and batch size: `generate` (model/generate.py) on --batch prompts of
--prompt-len tokens, --new-tokens greedy tokens each (no EOS stop), bf16 weights and KV cache, each decode
step replayed from a CUDA graph on both sides, blocks through torch.compile (Decoder(compile=True); CPU:
fp32, eager) (--no-graph: eager steps; --no-compile: the blocks as eager modules; --prefill-ffn: how the
prompts' pass runs TwELL layers, the Decoder's prefill_ffn, default auto). Time to first token = prefill
+ the first token on the host; decode tokens/s = batch x steps / the steps' wall time. Each figure is
the best of --repeats runs after a warm-up run (graph capture, Triton autotuning).

The model: a --models preset with random weights calibrated to the paper's activity (model/calibrate.py,
29 of 5632 units active per token, 30% dead) on the benchmark's prompts (random ids), or a trained one
(--checkpoint; prompts from --file through its tokenizer, else random ids). Dense and TwELL run the same
weights on the same prompts; TwELL's greedy tokens are compared with dense's: rows equal throughout,
the mean share of tokens before the first difference, and at each first difference the dense logits' gap
between the two tokens in bf16 steps (a gap of at most one step is a tie broken differently).
Each row also gives the bytes a decode step must read at the least (bf16 weights and cache: every
weight, w_up / w_down of the TwELL layers excepted, and the KV cache as the attention reads it: every
slot under sdpa's mask, each row's own positions under flash_decode), the bandwidth that makes of the
step time, and for TwELL the ceiling of its speed-up: dense's bytes over TwELL's when TwELL reads no
w_up / w_down row at all and both run at the same bandwidth. At large batches the KV cache is most of
the bytes on both sides and the ceiling falls towards 1.
Writes bench_generate.json, bench_generate.png and prints the table (--out folder).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

import torch
from bench_model import set_ffn_impl  # scripts/
from benchlib import bench_device

from twell.model import Decoder, ModelConfig, Transformer
from twell.model.calibrate import calibrate_activity
from twell.model.generate import DECODE_ATTENTION, PREFILL_FFN, cache_len_for, generate

IMPLS = ("dense", "twell")
WARM_TOKENS = 3  # the warm-up run: prefill, graph capture and two replays
# --quick: a model the interpreter runs in seconds
QUICK_SHAPE = dict(vocab_size=512, d_model=64, n_layers=1, n_heads=2, d_ff=128, max_seq_len=64)


def build_model(args, preset: str | None, device: torch.device):
    """(bf16 model on device, its name, the calibration report or None, the prompts [max batch, prompt_len])."""
    if args.checkpoint:
        from twell.eval.load import load_for_eval

        net, tokenizer_name = load_for_eval(args.checkpoint)
        net = net.to(device)
        prompts = make_prompts(args, net.cfg, tokenizer_name, device)
        report = None
        name = args.checkpoint
    else:
        overrides = dict(QUICK_SHAPE) if args.quick else {}
        needed = args.prompt_len + args.new_tokens
        base = ModelConfig.preset(preset, **overrides)
        cfg = ModelConfig.preset(preset, **{**overrides, "max_seq_len": max(base.max_seq_len, needed)})
        torch.manual_seed(args.seed)
        with torch.device(device):
            net = Transformer(cfg)
        prompts = make_prompts(args, cfg, None, device)
        calibration = calibrate_activity(net, prompts, mean_active=args.mean_active, seed=args.seed)
        report = vars(calibration)
        name = f"{preset} (random, calibrated)"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 matmuls are slow paths
    return net.to(dtype).eval(), name, report, prompts


def make_prompts(args, cfg: ModelConfig, tokenizer_name: str | None, device) -> torch.Tensor:
    """int64 [max batch, prompt_len]: the --file text's tokens cycled, else random ids."""
    rows = max(args.batch)
    n = rows * args.prompt_len
    if args.file:
        from twell.data import load_tokenizer

        with open(args.file, encoding="utf-8") as f:
            ids = load_tokenizer(tokenizer_name)(f.read(), add_special_tokens=False)["input_ids"]
        if not ids:
            raise SystemExit(f"error: --file {args.file} holds no text")
        flat = torch.tensor(ids, dtype=torch.int64).repeat(math.ceil(n / len(ids)))[:n]
        return flat.view(rows, args.prompt_len).to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    return torch.randint(0, cfg.vocab_size, (rows, args.prompt_len), generator=gen, device=device)


def run_variant(
    model: Transformer, prompts: torch.Tensor, args, device: torch.device
) -> tuple[dict, list[list[int]]]:
    """Warm up, then the best of --repeats generate() calls; (row of figures, the greedy tokens)."""
    if args.compile:
        # Every row compiles from scratch, as a fresh process would: torch.compile specialises a prefill
        # to the first prompt shape it meets and makes the graph dynamic on the next one, so rows run
        # after another batch size would otherwise time a different (dynamic-shape) graph.
        torch._dynamo.reset()
    max_len = cache_len_for(model.cfg.max_seq_len, args.prompt_len, args.new_tokens)
    decoder = Decoder(
        model, len(prompts), max_len, cuda_graph=args.graph, compile=args.compile, fuse_qkv=args.fuse_qkv,
        prefill_ffn=args.prefill_ffn, attention=args.attention,
    )  # fmt: skip
    generate(model, prompts, WARM_TOKENS, decoder=decoder)
    runs = [generate(model, prompts, args.new_tokens, decoder=decoder) for _ in range(args.repeats)]
    best = min(runs, key=lambda run: run.decode_s)
    row = {
        "batch": len(prompts),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "graph": args.graph,
        "compiled": args.compile,
        "fused_qkv": decoder.fused_qkv,
        "prefill_ffn": args.prefill_ffn,
        "attention": args.attention,
        "ttft_ms": min(run.time_to_first_token_s for run in runs) * 1e3,
        "decode_tok_s": len(prompts) * best.steps / best.decode_s,
        "step_ms": best.decode_s / best.steps * 1e3,
        "cache_gib": decoder.cache.nbytes() / 2**30,
        "sparse_layers": sum(block.ffn.impl != "dense" for block in model.layers),
    }
    element = next(model.parameters()).element_size()
    row["step_bytes"], row["dense_step_bytes"] = (
        step_bytes(
            model.cfg, len(prompts), args.prompt_len, args.new_tokens, max_len, args.attention, n, element
        )
        for n in (row["sparse_layers"], 0)
    )
    row["tb_s"] = row["step_bytes"] / (row["step_ms"] * 1e-3) / 1e12
    if args.profile:
        row["profile"] = profile_steps(model, decoder, prompts, args)
    del decoder
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, best.tokens


def step_bytes(
    cfg: ModelConfig,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    cache_len: int,
    attention: str,
    sparse_layers: int,
    element: int = 2,
) -> int:
    """Bytes one decode step reads at the least, averaged over the new_tokens - 1 steps after the prefill:
    every weight read once (the tied head too; embedding rows and norms are negligible), w_up and w_down
    only in the n_layers - sparse_layers dense FFNs (a TwELL layer's floor: its gate alone), and the KV
    cache: every one of cache_len slots a row under "sdpa" (its mask hides the unused ones from the
    result, not from the read), the row's own positions under "flash_decode" (prompt_len + i at step i)."""
    d, kv_width = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    attn = 2 * d * d + 2 * d * kv_width  # q and o, k and v
    ffn_gate, ffn_up_down = cfg.d_ff * d, 2 * cfg.d_ff * d
    weights = (
        cfg.n_layers * (attn + ffn_gate) + (cfg.n_layers - sparse_layers) * ffn_up_down + cfg.vocab_size * d
    )
    if attention == "flash_decode":
        slots = prompt_len + new_tokens / 2  # mean of prompt_len + i over steps i = 1 .. new_tokens - 1
    else:
        slots = cache_len
    cache = cfg.n_layers * batch * slots * 2 * kv_width
    return int((weights + cache) * element)


PROFILE_STEPS = 20


def profile_steps(model: Transformer, decoder: Decoder, prompts: torch.Tensor, args) -> str:
    """--profile: where a decode step's time goes. PROFILE_STEPS steps after a prefill, as the timed
    runs take them, under torch.profiler; writes the per-kernel table (GPU time, calls) to
    --profile/<model>_<ffn>_b<batch>.txt and returns its path."""
    from torch.profiler import ProfilerActivity, profile

    logits = decoder.prefill(prompts.tolist())
    token = logits.argmax(-1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if prompts.is_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            token = decoder.step(token).argmax(-1)
        if prompts.is_cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if prompts.is_cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
    ffn = "twell" if any(block.ffn.impl != "dense" for block in model.layers) else "dense"
    path = Path(args.profile) / f"{model.cfg.name}_{ffn}_b{len(prompts)}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{PROFILE_STEPS} decode steps, graph={args.graph}, compiled={args.compile}\n{table}\n")
    return str(path)


@torch.no_grad()
def agreement(
    model: Transformer, prompts: torch.Tensor, dense: list[list[int]], sparse: list[list[int]]
) -> dict:
    """How far TwELL's greedy tokens follow dense's, and at each first difference the gap between the
    two tokens' dense logits (in bf16 steps at the larger logit's magnitude; <= 1: a tie)."""
    diverged, shares = [], []
    for row, (d, s) in enumerate(zip(dense, sparse)):
        k = next((i for i, (a, b) in enumerate(zip(d, s)) if a != b), len(d))
        shares.append(k / len(d))
        if k < len(d):
            diverged.append((prompts[row].tolist() + d[:k], d[k], s[k]))
    gaps = []
    if diverged:
        set_ffn_impl(model, "dense")
        longest = max(len(p) for p, _, _ in diverged)
        decoder = Decoder(model, len(diverged), cache_len_for(model.cfg.max_seq_len, longest, 1))
        logits = decoder.prefill([p for p, _, _ in diverged]).float()
        for row, (_, want, got) in enumerate(diverged):
            high = logits[row, want].abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
            step = 2.0 ** (torch.floor(torch.log2(high)) - 7)  # bf16: 8 significant bits
            gaps.append(float((logits[row, want] - logits[row, got]) / step))
    return {
        "rows_equal": len(dense) - len(diverged),
        "rows": len(dense),
        "equal_share": sum(shares) / len(shares),
        "ties": sum(g <= 1 for g in gaps),
        "gap_steps": gaps,
    }


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'model':>6} {'ffn':>6} {'batch':>5} {'TTFT ms':>9} {'x':>5} {'decode tok/s':>12} {'x dense':>7} "
        f"{'step ms':>8} {'GB/step':>8} {'TB/s':>5} {'ceiling':>7} {'equal rows':>10} {'ties':>5}"
    )
    lines = [head]
    for r in rows:
        equal = (
            "-" if r.get("agreement") is None else f"{r['agreement']['rows_equal']}/{r['agreement']['rows']}"
        )
        ties = "-" if r.get("agreement") is None else str(r["agreement"]["ties"])
        ceiling = r["dense_step_bytes"] / r["step_bytes"]
        lines.append(
            f"{r['model']:>6} {r['impl']:>6} {r['batch']:>5} {r['ttft_ms']:>9.2f} {r['ttft_vs_dense']:>5.2f} "
            f"{r['decode_tok_s']:>12.1f} {r['x_dense']:>7.3f} {r['step_ms']:>8.3f} {r['step_bytes'] / 1e9:>8.3f} "
            f"{r['tb_s']:>5.2f} {ceiling:>6.2f}x {equal:>10} {ties:>5}"
        )
    lines.append(
        "GB/step: the least a decode step reads (weights once, TwELL layers' gate only, the KV cache as the "
        "attention reads it); TB/s: that over the step time; ceiling: dense's bytes over these, the most the "
        "row can gain at dense's bandwidth"
    )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in rows}, key=lambda g: (g[0], g[1]))
    by_key = {(r["model"], r["batch"], r["impl"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        ("decode_tok_s", "decode tokens / s (higher is better)"),
        ("ttft_ms", "time to first token, ms"),
    )
    colors = {"dense": "#9e9e9e", "twell": "#1565c0"}
    for ax, (key, title) in zip(axes, panels):
        for j, impl in enumerate(IMPLS):
            for i, (model, batch) in enumerate(groups):
                row = by_key.get((model, batch, impl))
                if row is None:
                    continue
                x = i + (j - 0.5) * 0.4
                ax.bar(x, row[key], 0.4, color=colors[impl], label=impl if i == 0 else None)
                if impl == "twell":
                    ratio = row["x_dense"] if key == "decode_tok_s" else row["ttft_vs_dense"]
                    ax.text(x, row[key], f"{ratio:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), [f"{m}\nbatch {b}" for m, b in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "bench_generate.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["0.5b", "1.5b"], help="presets (random, calibrated)")
    p.add_argument("--checkpoint", default=None, help="a trained model instead of the presets")
    p.add_argument("--file", default=None, help="with --checkpoint: text whose tokens fill the prompts")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (the best is kept)")
    p.add_argument("--mean-active", type=float, default=29.0, help="calibration target, units per token")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="eager decode steps")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="blocks as eager modules (no torch.compile)",
    )
    p.add_argument(
        "--no-fuse-qkv", dest="fuse_qkv", action="store_false", default=None,
        help="q, k and v as three projections (default: one fused weight where compiled)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-ffn", choices=PREFILL_FFN, default="auto",
        help="how the prefill runs TwELL layers: auto (dense below 16,384 prompt tokens), dense, model (TwELL)",
    )  # fmt: skip
    p.add_argument(
        "--attention", choices=DECODE_ATTENTION, default="sdpa",
        help="how a decode step attends: sdpa (PyTorch, masked cache) or flash_decode (Triton, split keys)",
    )  # fmt: skip
    p.add_argument("--profile", default=None, help="folder: a per-kernel profile of the decode steps per row")
    p.add_argument(
        "--quick", action="store_true", help="CPU smoke test: small model, batch 1 2, 8 + 3 tokens"
    )
    p.add_argument("--device", default=None, help="default: cuda (a CPU needs --device cpu, or --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/bench_generate", help="folder for the JSON and PNG")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.batch, args.prompt_len, args.new_tokens = ["tiny"], [1, 2], 8, 3
        args.repeats, args.mean_active = 1, 8.0
    if args.file and not args.checkpoint:
        p.error("--file needs --checkpoint (a calibrated random model takes random ids)")
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) < 1 or (name == "new_tokens" and args.new_tokens < 2):
            p.error(
                f"--{name.replace('_', '-')}={getattr(args, name)} is too small (new tokens >= 2, else >= 1)"
            )
    if min(args.batch) < 1:
        p.error(f"--batch {args.batch}: every batch size must be >= 1")
    args.device = bench_device(p, args.device, "--quick", cpu_ok=args.quick)
    args.graph = args.graph and torch.device(args.device).type == "cuda"
    args.compile = args.compile and torch.device(args.device).type == "cuda"
    return args


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, calibrations = [], {}
    start = time.perf_counter()
    for preset in [None] if args.checkpoint else args.models:
        model, name, calibration, prompts = build_model(args, preset, device)
        label = preset or "ckpt"
        calibrations[label] = calibration
        cfg = model.cfg
        print(f"{name}: {cfg.n_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}", flush=True)
        tokens = {}
        for impl in IMPLS:
            set_ffn_impl(model, impl)
            for batch in args.batch:
                print(f"  {impl} batch {batch} ...", flush=True)
                row, tokens[impl, batch] = run_variant(model, prompts[:batch], args, device)
                rows.append({"model": label, "impl": impl, **row})
        for batch in args.batch:
            dense = next(r for r in rows if (r["model"], r["impl"], r["batch"]) == (label, "dense", batch))
            sparse = next(r for r in rows if (r["model"], r["impl"], r["batch"]) == (label, "twell", batch))
            for r in (dense, sparse):
                r["x_dense"] = r["decode_tok_s"] / dense["decode_tok_s"]
                r["ttft_vs_dense"] = r["ttft_ms"] / dense["ttft_ms"]
            sparse["agreement"] = agreement(model, prompts, tokens["dense", batch], tokens["twell", batch])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(format_table(rows))
    doc = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": _commit(),
        "seconds": time.perf_counter() - start,
        "config": vars(args),
        "calibration": calibrations,
        "rows": rows,
    }
    (out / "bench_generate.json").write_text(json.dumps(doc, indent=1))
    png = plot(rows, out)
    print(f"wrote {out / 'bench_generate.json'} and {png} ({doc['seconds']:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
