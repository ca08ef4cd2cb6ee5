"""Whole-model speed, energy and memory, dense FFNs against TwELL: the paper's "Speed" table.

    python scripts/bench_model.py                                  # 0.5b: inference 64 x 2048, a training step of 8 x 2048
    python scripts/bench_model.py --model 1.5b --out bench_model_1.5b.json
    python scripts/bench_model.py --model 1.5b --mode train --cuda-graph --compile
    python scripts/bench_model.py --checkpoint exported/sparselm-1.5b --file held_out.txt

Inference (`--mode infer`): the decoder stack (embedding, blocks, final norm; no output head, as the
paper times it) on --batch sequences of --seq-len tokens, bf16 weights, under torch.no_grad. Training
(`--mode train`): one optimizer step on --micro-batch sequences as the trainer takes it (bf16 autocast
over fp32 weights, CE + l1_coef * L1, backward, gradient clipping, fused AdamW), eagerly or, with
--cuda-graph, replayed from a CUDA graph as train.cuda_graph=true does (training/cuda_graph.py). Data
loading, logging and dead-unit re-initialisation are not timed. Each variant runs the same weights
on the same tokens; training starts every variant from the same weights and optimizer state.

Per variant: median ms per forward / step, tokens per ms, energy per token (the GPU's NVML energy
counter read around a loop of at least --seconds), mean board power, peak memory, the FFN activity
the model showed (mean active units per token over layers, and the densest layer), and for TwELL the
largest relative row error of its hidden states against the dense path's (inference).

The model: a --model preset with random weights calibrated to the paper's activity (model/calibrate.py:
29 active of 5632 hidden units per token in every layer, 30% dead units, log-normal firing rates) on
the very tokens it is timed on (one batch of random ids; training takes its first --micro-batch rows),
or a trained one (--checkpoint: a Hugging Face folder or a trainer checkpoint; tokens from --file
through its tokenizer, else random ids). Training steps run at --lr 0 by default: AdamW does the same
work, and the weights, hence the activity, stay as calibrated (a real run keeps its activity through
the L1 term; a few benchmark steps of Adam from a random model do not). Writes a table and JSON (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import time

import torch
from benchlib import bench_device, write_results

from twell.model import ModelConfig, Transformer
from twell.model.calibrate import calibrate_activity

MODES = ("infer", "train")
# Hidden states after the whole bf16 stack: per-layer rounding adds up (H200, 8 / 38 layers: compiled
# dense differs from eager dense by 1.1e-2 / 2.2e-2 per row, TwELL by 1.1e-2 / 2.1e-2).
ROW_TOLERANCE = 3e-2
ORDER_ROWS = 4  # --hot-prefix: untimed rows (x seq-len tokens) whose unit firing orders each FFN


class EnergyMeter:
    """The GPU's total-energy counter (NVML, millijoules since the driver loaded); None off a GPU or
    without NVML (`reason` says why)."""

    def __init__(self, device: torch.device):
        self.handle, self.reason = None, ""
        if device.type != "cuda":
            self.reason = "not a CUDA device"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            to_nvml = getattr(torch.cuda, "_get_nvml_device_index", None)  # honours CUDA_VISIBLE_DEVICES
            handle = pynvml.nvmlDeviceGetHandleByIndex(to_nvml(index) if to_nvml else index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self._nvml, self.handle = pynvml, handle
        except Exception as err:  # no pynvml, or a GPU without the counter
            self.reason = f"{type(err).__name__}: {err}"

    def read_mj(self) -> float | None:
        if self.handle is None:
            return None
        return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loop(fn, device: torch.device, seconds: float, meter: EnergyMeter, min_iters: int = 3) -> dict:
    """Run fn() (already warmed up) for at least `seconds` and min_iters calls: median ms per call,
    and the energy the GPU drew over the whole loop per call (None without a meter)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    iters = max(min_iters, math.ceil(seconds / max(time.perf_counter() - start, 1e-6)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    times = []
    e0 = meter.read_mj()
    wall = time.perf_counter()
    for i in range(iters):
        if device.type == "cuda":
            events[i].record()
        else:
            t = time.perf_counter()
        fn()
        if device.type != "cuda":
            times.append((time.perf_counter() - t) * 1e3)
    if device.type == "cuda":
        events[iters].record()
    synchronize(device)
    wall = time.perf_counter() - wall
    e1 = meter.read_mj()
    if device.type == "cuda":
        times = [events[i].elapsed_time(events[i + 1]) for i in range(iters)]
    times.sort()
    result = {"iters": iters, "ms": times[len(times) // 2], "loop_s": wall, "energy_mj": None, "watts": None}
    if e0 is not None:
        result["energy_mj"] = (e1 - e0) / iters
        result["watts"] = (e1 - e0) / 1e3 / wall
    result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return result


def set_ffn_impl(model: Transformer, impl: str) -> None:
    for block in model.layers:
        block.ffn.impl = impl


def activity_of(model: Transformer, tokens: torch.Tensor) -> dict:
    """Mean active FFN units per token over layers and the densest layer's mean, on `tokens`."""
    with torch.no_grad():
        stats = model(tokens).stats
    per_layer = stats.active_mean.float().cpu()
    return {"active_mean": float(per_layer.mean()), "active_layer_max": float(per_layer.max())}


def row_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest over rows of |y - ref| / |ref| (float32)."""
    y, ref = y.float().flatten(0, -2), ref.float().flatten(0, -2)
    return float(((y - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-12)).max())


def bench_inference(
    model: Transformer, tokens, variants, device, seconds, meter, warmup, min_iters=3, hot_prefix=0,
    order_tokens=None,
) -> list[dict]:  # fmt: skip
    """Decoder-stack forwards of bf16 copies of `model`, one row per (name, impl, compile) variant.
    hot_prefix > 0: the copy's FFN units are first ordered on `order_tokens` (untimed rows) and the
    TwELL variants compute that many of them densely (Transformer.order_ffn_units)."""
    net = copy.deepcopy(model).to(torch.bfloat16).eval()
    set_ffn_impl(net, "dense")
    if hot_prefix:
        shares = net.order_ffn_units(order_tokens, hot_prefix)
        print(
            f"hot prefix {hot_prefix}: share of active units in it by layer "
            + " ".join(f"{s:.2f}" for s in shares)
        )
    activity = activity_of(net, tokens[: max(1, 16384 // tokens.shape[1])])
    rows, reference = [], None
    for name, impl, compile_blocks in variants:
        print(f"infer {name} ...", flush=True)
        set_ffn_impl(net, impl)
        runner = net
        if compile_blocks:
            runner = copy.deepcopy(net)
            _compile_blocks(runner)
        with torch.no_grad():
            fn = functools.partial(runner.hidden_states, tokens)  # one forward, timed
            for _ in range(warmup):
                out = fn()
            if reference is None:
                reference = out
            err = row_error(out, reference)
            del out
            result = timed_loop(fn, device, seconds, meter, min_iters)
        row = {"mode": "infer", "variant": name, "impl": impl, "compile": compile_blocks, "graph": False}
        row.update(result, tokens=tokens.numel(), max_row_err=err, **activity)
        rows.append(row)
        del runner, fn
        _free(device)
    return rows


def _compile_blocks(model: Transformer) -> None:
    from twell.training.trainer import apply_block_wrappers

    apply_block_wrappers(model, activation_checkpointing=False, compile_blocks=True)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_train(
    model: Transformer, ids, labels, variants, device, seconds, meter, warmup, lr, l1_coef, min_iters=3
) -> list[dict]:
    """Optimizer steps of copies of `model` (fp32 weights, bf16 autocast on CUDA), one row per
    (name, impl, compile, graph) variant, each from the same weights and a fresh optimizer."""
    from twell.training.config import OptimConfig
    from twell.training.optim import build_optimizer
    from twell.training.trainer import micro_loss

    rows = []
    for name, impl, compile_blocks, graph in variants:
        print(f"train {name} ...", flush=True)
        net = copy.deepcopy(model).float().train()
        set_ffn_impl(net, impl)
        if compile_blocks:
            _compile_blocks(net)
        params = [p for p in net.parameters() if p.requires_grad]
        optimizer = build_optimizer(net, OptimConfig(), device)
        for group in optimizer.param_groups:  # as the trainer's schedule sets it (0 is allowed here)
            group["lr"] = lr
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=not graph)
            if device.type == "cuda"
            else contextlib.nullcontext()
        )

        loss_fn = functools.partial(micro_loss, net, autocast)  # the trainer's own
        graphed = None
        if graph:
            from twell.training.cuda_graph import GraphedMicroStep

            graphed = GraphedMicroStep(params, loss_fn, 1, device)
        last = {}  # the latest step's activity statistics
        step = functools.partial(
            _train_step,
            loss_fn,
            graphed,
            optimizer,
            params,
            ids,
            labels,
            l1_coef,
            tuple(net.ffn_routing()),
            last,
        )
        for _ in range(warmup):
            step()
        result = timed_loop(step, device, seconds, meter, min_iters)
        per_layer = last["stats"].active_mean.float().cpu()
        row = {"mode": "train", "variant": name, "impl": impl, "compile": compile_blocks, "graph": graph}
        row.update(result, tokens=ids.numel(), max_row_err=None)
        row.update(active_mean=float(per_layer.mean()), active_layer_max=float(per_layer.max()))
        if graphed is not None:
            row.update(captures=graphed.captures, redone_steps=graphed.redone_steps)
        rows.append(row)
        del net, optimizer, graphed, params, step, loss_fn
        _free(device)
    return rows


def _train_step(loss_fn, graphed, optimizer, params, ids, labels, l1_coef, routing, last) -> None:
    """One optimizer step: replayed from the graph when there is one (an eager redo after a capacity
    miss, as the trainer does), clipped at 1.0, AdamW."""
    from twell.training.trainer import clip_grad_norm

    replayed = graphed.run_step([(ids, labels)], l1_coef, routing) if graphed is not None else None
    if replayed is None:
        if graphed is not None:
            graphed.zero_grads()  # a capacity miss: nothing of the replay is kept
        loss, _, out = loss_fn(ids, labels, l1_coef)
        loss.backward()
        last["stats"] = out.stats
    else:
        last["stats"] = replayed[0][2]
    clip_grad_norm(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=graphed is None)


def add_ratios(rows: list[dict]) -> None:
    """Speed-up and energy ratio of every row against the same mode's first (dense) row."""
    for mode in MODES:
        group = [r for r in rows if r["mode"] == mode]
        if not group:
            continue
        base = group[0]
        for r in group:
            r["tokens_per_ms"] = r["tokens"] / r["ms"]
            r["x_dense"] = base["ms"] / r["ms"]
            r["mj_per_token"] = None if r["energy_mj"] is None else r["energy_mj"] / r["tokens"]
            r["energy_vs_dense"] = (
                None
                if r["energy_mj"] is None or not base["energy_mj"]
                else r["energy_mj"] / base["energy_mj"]
            )


def format_table(rows: list[dict]) -> str:
    def num(value, fmt):
        return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))

    head = (
        f"{'mode':>5} {'variant':>14} {'tokens':>7} {'ms':>9} {'tok/ms':>8} {'x dense':>7} {'mJ/tok':>8} "
        f"{'E/dense':>7} {'W':>5} {'peak GiB':>8} {'active':>7} {'max L':>6} {'row err':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['mode']:>5} {r['variant']:>14} {r['tokens']:>7} {r['ms']:>9.3f} {r['tokens_per_ms']:>8.2f} "
            f"{r['x_dense']:>7.3f} {num(r['mj_per_token'], '8.4f')} {num(r['energy_vs_dense'], '7.3f')} "
            f"{num(r['watts'], '5.0f')} {num(r['peak_gib'], '8.2f')} {r['active_mean']:>7.1f} "
            f"{r['active_layer_max']:>6.1f} {num(r['max_row_err'], '8.2e')}"
        )
    return "\n".join(lines)


def build_model(args, device: torch.device) -> tuple[Transformer, object | None]:
    """(model in fp32 on device, its tokenizer or None): a checkpoint, or a preset at its init."""
    if args.checkpoint:
        from twell.eval.load import load_for_eval

        net, tokenizer_name = load_for_eval(args.checkpoint, preset=args.model if args.model_given else None)
        tokenizer = None
        if args.file:
            from twell.data import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_name)
        return net.to(device), tokenizer
    cfg = ModelConfig.preset(
        args.model, max_seq_len=max(args.seq_len, ModelConfig.preset(args.model).max_seq_len)
    )
    with torch.device("meta"):
        net = Transformer(cfg)
    net.to_empty(device=device)
    torch.manual_seed(args.seed)
    net.init_weights()
    return net, None


def make_tokens(args, cfg: ModelConfig, tokenizer, rows: int, device: torch.device) -> torch.Tensor:
    """[rows, seq_len + 1] token ids: the --file text's tokens cycled, else random ids."""
    n = rows * (args.seq_len + 1)
    if tokenizer is not None:
        with open(args.file) as f:
            ids = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
        if not ids:
            raise SystemExit(f"error: --file {args.file} holds no text")
        ids = torch.tensor(ids, dtype=torch.int64).repeat(math.ceil(n / len(ids)))[:n]
        return ids.view(rows, args.seq_len + 1).to(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 2)
    return torch.randint(0, cfg.vocab_size, (rows, args.seq_len + 1), generator=gen, device=device)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="preset (tiny, 125m, 0.5b, 1b, 1.5b, 2b; default 0.5b)")
    p.add_argument("--checkpoint", default=None, help="a trained model instead of a calibrated random one")
    p.add_argument("--file", default=None, help="with --checkpoint: text whose tokens fill the batches")
    p.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--batch", type=int, default=64, help="inference sequences (paper: 64)")
    p.add_argument("--micro-batch", type=int, default=8, help="training sequences per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--mean-active", type=float, default=29.0, help="calibration target, units per token")
    p.add_argument(
        "--compile", action="store_true", help="also time torch.compile'd blocks (dense and TwELL)"
    )
    p.add_argument(
        "--cuda-graph", action="store_true", help="training: also replay each step from a CUDA graph"
    )
    p.add_argument("--seconds", type=float, default=3.0, help="timed loop length per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-iters", type=int, default=3, help="timed calls per variant at least")
    p.add_argument(
        "--lr", type=float, default=0.0, help="training steps' AdamW LR (0: the same work, the weights kept)"
    )
    p.add_argument("--l1-coef", type=float, default=2e-5)
    p.add_argument(
        "--hot-prefix", type=int, default=0,
        help="inference: order FFN units on untimed rows and compute the first P densely (0: off)",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="default: cuda (a CPU needs --device cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_model.json")
    args = p.parse_args(argv)
    args.model_given = args.model is not None
    args.model = args.model or "0.5b"
    if args.file and not args.checkpoint:
        p.error("--file needs --checkpoint (a calibrated random model takes random ids)")
    if args.lr < 0:
        p.error(f"--lr={args.lr} must be >= 0")
    for name in ("batch", "micro_batch", "seq_len", "warmup", "min_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    args.device = bench_device(p, args.device, "--model tiny --device cpu --seq-len 32 --batch 4 --seconds 0")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.cuda_graph and device.type != "cuda":
        raise SystemExit(
            f"error: --cuda-graph needs a CUDA device (got --device {args.device}); leave it out"
        )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model, tokenizer = build_model(args, device)
    cfg = model.cfg
    if args.seq_len > cfg.max_seq_len:
        raise SystemExit(f"error: --seq-len {args.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
    # One batch of rows: inference times the first --batch, training the first --micro-batch (its
    # labels are the next tokens). A random model is calibrated on exactly those tokens, so what is
    # timed runs at the target activity (on other tokens of the kind it is close: tests/model).
    rows_needed = max(
        args.batch if "infer" in args.mode else 0, args.micro_batch if "train" in args.mode else 0
    )
    if args.hot_prefix and "infer" in args.mode:  # untimed rows that order the units
        rows_needed = max(rows_needed, args.batch + ORDER_ROWS)
    batch = make_tokens(args, cfg, tokenizer, rows_needed, device)
    calibration = None
    if not args.checkpoint:
        calibration = calibrate_activity(model, batch[:, :-1], mean_active=args.mean_active, seed=args.seed)
    meter = EnergyMeter(device)
    name = args.checkpoint or f"{args.model} (random, calibrated)"
    print(
        f"model {name}: {cfg.n_layers} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {model.num_params() / 1e9:.3f}B parameters"
    )
    if calibration is not None:
        print(
            f"calibrated on {calibration.tokens} tokens: active units per token by layer "
            + " ".join(f"{a:.1f}" for a in calibration.active_mean)
            + f"; never fired {sum(calibration.never_fired) / len(calibration.never_fired):.1%}"
        )
    if meter.handle is None:
        print(f"no energy counter ({meter.reason}): energy columns stay empty")
    rows = []
    if "infer" in args.mode:
        tokens = batch[: args.batch, :-1].contiguous()
        variants = [("dense", "dense", False), ("twell", "twell", False)]
        if args.compile:
            variants += [("dense+compile", "dense", True), ("twell+compile", "twell", True)]
        order_tokens = batch[args.batch : args.batch + ORDER_ROWS, :-1] if args.hot_prefix else None
        rows += bench_inference(
            model, tokens, variants, device, args.seconds, meter, args.warmup, args.min_iters, args.hot_prefix,
            order_tokens,
        )  # fmt: skip
    if "train" in args.mode:
        ids, labels = batch[: args.micro_batch, :-1].contiguous(), batch[: args.micro_batch, 1:].contiguous()
        variants = [("dense", "dense", False, False), ("twell", "twell", False, False)]
        if args.compile:
            variants += [("dense+compile", "dense", True, False), ("twell+compile", "twell", True, False)]
        if args.cuda_graph:
            variants += [("dense+graph", "dense", False, True), ("twell+graph", "twell", False, True)]
        rows += bench_train(
            model,
            ids,
            labels,
            variants,
            device,
            args.seconds,
            meter,
            args.warmup,
            args.lr,
            args.l1_coef,
            args.min_iters,
        )
    add_ratios(rows)
    print(format_table(rows))
    bad = [r["variant"] for r in rows if r["max_row_err"] is not None and r["max_row_err"] > ROW_TOLERANCE]
    if bad:
        print(f"WARNING: hidden-state row error above {ROW_TOLERANCE} in {bad}")
    write_results(
        args.out,
        rows,
        model=name,
        config={k: v for k, v in vars(args).items()},
        calibration=None if calibration is None else vars(calibration),
        energy=meter.reason or "nvml total energy counter",
    )
    return rows


if __name__ == "__main__":
    main()
