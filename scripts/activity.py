"""Print and plot a checkpoint's FFN activity on given text: per layer and per token position.

    python scripts/activity.py checkpoint=outputs/quickstart/checkpoints --text "The cat sat on the mat."
    python scripts/activity.py checkpoint=<step dir> model=tiny --file notes.txt --seq-len 128
    python scripts/activity.py checkpoint=outputs/run/checkpoints --val-rows 8 --data local
    python scripts/activity.py checkpoint=exported/sparselm-1.5b --val-rows 8 --data fineweb_edu \\
        --dump-ffn-inputs acts.pt --layer 3          # then: scripts/bench_ffn.py --activations acts.pt

checkpoint=..., model=<preset>, tokenizer=..., device=... and ModelConfig overrides (key=value) are
read as by scripts/eval.py (a Hugging Face folder, a step_* folder, or a checkpoints folder).
Text: --text, --file, or --val-rows N (N packed rows of the held-out data, as training sees them,
from the run's data config or --data NAME|YAML). Long text is cut into --seq-len pieces, each a
sequence that starts at position 0.
Writes <out>.json and <out>.png (default: activity.* next to the checkpoint). With
--dump-ffn-inputs PATH it also saves the chosen layers' FFN inputs and weights in
bench_ffn.py's format (several layers: PATH's stem + .layerNN.pt).
"""

import argparse
from pathlib import Path

import torch

from twell.data import DataConfig, load_tokenizer
from twell.eval.activity import (
    ActivityMeter,
    batches_of,
    dump_ffn_inputs,
    parse_layers,
    plot_report,
    text_sequences,
    validation_rows,
)
from twell.eval.load import (
    find_run_config,
    is_hf_folder,
    latest_step_dir,
    load_for_eval,
    parse_settings,
)

LOAD_KEYS = {"checkpoint", "model", "tokenizer", "device"}
DTYPES = {"model": None, "bf16": torch.bfloat16, "fp32": torch.float32}
REPO = Path(__file__).resolve().parents[1]


def run_config_of(checkpoint: Path) -> dict:
    if is_hf_folder(checkpoint):
        return {}
    return find_run_config(latest_step_dir(checkpoint, quiet=True)) or {}


def data_config(spec: str | None, run_cfg: dict) -> DataConfig:
    """--data NAME (configs/data/NAME.yaml) or a YAML path; else the run's own data section."""
    if spec is None:
        if not run_cfg.get("data"):
            raise SystemExit(
                "error: --val-rows needs a data config: this checkpoint has no run config with a data: "
                "section; pass --data <name in configs/data/ or a YAML file>"
            )
        return DataConfig.from_any(run_cfg["data"])
    from omegaconf import OmegaConf

    path = Path(spec)
    if not path.is_file():
        path = REPO / "configs" / "data" / f"{spec}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (REPO / "configs" / "data").glob("*.yaml"))
        raise SystemExit(f"error: --data {spec!r} is neither a YAML file nor one of configs/data/: {known}")
    return DataConfig.from_any(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="+", help="checkpoint=PATH [model=PRESET] [tokenizer=...] [field=value]")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to run")
    source.add_argument("--file", help="a UTF-8 text file to run")
    source.add_argument("--val-rows", type=int, help="N packed rows of the configured validation data")
    p.add_argument("--data", help="data config for --val-rows: a name in configs/data/ or a YAML file")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the run's train.seq_len)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--out", help="output stem for .json and .png (default: <checkpoint>/activity)")
    p.add_argument("--dump-ffn-inputs", metavar="PATH", help="save FFN inputs + weights for bench_ffn.py")
    layer = p.add_mutually_exclusive_group()
    layer.add_argument("--layer", help="layer(s) to dump: an index or a comma-separated list (default 0)")
    layer.add_argument("--layers", help="'all' or a comma-separated list")
    p.add_argument("--dump-dtype", choices=sorted(DTYPES), default="model", help="dtype of the dump")
    args = p.parse_args(argv)
    options, overrides = parse_settings(
        args.settings, LOAD_KEYS, " (see --help)", expected="key=value or a --flag"
    )
    if args.file and not Path(args.file).is_file():
        raise SystemExit(f"error: --file {args.file} does not exist (give a UTF-8 text file, or use --text)")

    checkpoint = Path(options["checkpoint"])
    net, tokenizer_name = load_for_eval(
        checkpoint, preset=options.get("model"), tokenizer=options.get("tokenizer"), **overrides
    )
    run_cfg = run_config_of(checkpoint)
    seq_len = args.seq_len or (run_cfg.get("train") or {}).get("seq_len") or net.cfg.max_seq_len
    if not 1 <= seq_len <= net.cfg.max_seq_len:
        raise SystemExit(
            f"error: --seq-len {seq_len} must be in 1..{net.cfg.max_seq_len} (the model's max_seq_len)"
        )
    capture = []
    if args.dump_ffn_inputs:
        try:
            capture = parse_layers(args.layers or args.layer or "0", net.cfg.n_layers)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
    elif args.layer or args.layers:
        raise SystemExit(
            "error: --layer/--layers choose what --dump-ffn-inputs PATH saves; add --dump-ffn-inputs"
        )

    device = options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    net = net.to(device).eval()
    tokenizer = load_tokenizer(tokenizer_name)
    if args.val_rows is not None:
        batches = validation_rows(
            data_config(args.data, run_cfg), tokenizer, seq_len, args.val_rows, args.batch_size
        )
        what = f"{args.val_rows} validation rows"
    else:
        text = args.text if args.text is not None else Path(args.file).read_text(encoding="utf-8")
        batches = batches_of(text_sequences(tokenizer, text, seq_len), args.batch_size)
        what = "--text" if args.text is not None else args.file

    from tqdm import tqdm

    with ActivityMeter(net, seq_len, capture_layers=capture) as meter:
        for tokens in tqdm(batches, desc="forward", unit="batch", disable=None):
            meter.run(tokens)
    report = meter.report()
    print(f"model: {net.cfg.num_params() / 1e6:.2f}M parameters, {checkpoint}, on {what}, device {device}")
    print(report.table())

    stem = (
        Path(args.out)
        if args.out
        else (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "activity"
    )
    json_path = report.save_json(
        stem.with_suffix(".json"), checkpoint=getattr(net, "source", str(checkpoint))
    )
    png_path = plot_report(report, stem.with_suffix(".png"), title=f"{checkpoint.name}: {what}")
    print(f"wrote {json_path} and {png_path}")
    if capture:
        for layer_index, path in dump_ffn_inputs(
            meter, args.dump_ffn_inputs, DTYPES[args.dump_dtype]
        ).items():
            print(f"layer {layer_index}: FFN inputs of {report.tokens} tokens -> {path}")


if __name__ == "__main__":
    main()
