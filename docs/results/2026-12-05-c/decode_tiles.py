"""Issue 34: the 1.5b decode step with the fused FFN kernel at 64, 32 and 16 units per program (d_ff / tile
programs for its gate GEMV: 88, 176, 352 at d_ff 5632 on the H200's 132 SMs), against the dense twin, in the
real generation path (bench_generate's calibrated model, compiled blocks, CUDA graphs, fused q/k/v).

    python docs/results/2026-12-05-c/decode_tiles.py out.json [--batch 1 8] [--tiles 64 32 16]
"""

import argparse
import json
import sys

import torch
from bench_generate import build_model, parse_args, run_variant
from bench_model import set_ffn_impl

from twell.kernels.inference import inference


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--tiles", type=int, nargs="+", default=[64, 32, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    own = p.parse_args()
    args = parse_args(["--models", "1.5b", "--batch", *map(str, own.batch), "--new-tokens", str(own.new_tokens),
                       "--repeats", "2"])  # fmt: skip
    device = torch.device("cuda")
    model, name, _, prompts = build_model(args, "1.5b", device)
    rows = []
    set_ffn_impl(model, "dense")
    for batch in own.batch:
        row, _ = run_variant(model, prompts[:batch], args, device)
        rows.append({"impl": "dense", "tile": None, **row})
        print(
            f"dense      batch {batch}: {row['decode_tok_s']:8.1f} tok/s, step {row['step_ms']:.3f} ms",
            flush=True,
        )
    set_ffn_impl(model, "twell")
    for tile in own.tiles:
        inference.default_fused_tile = lambda d_ff, tile=tile: tile
        for batch in own.batch:
            row, _ = run_variant(model, prompts[:batch], args, device)
            dense = next(r for r in rows if r["impl"] == "dense" and r["batch"] == batch)
            row["x_dense"] = row["decode_tok_s"] / dense["decode_tok_s"]
            rows.append({"impl": "twell", "tile": tile, **row})
            print(f"twell t{tile:<3}  batch {batch}: {row['decode_tok_s']:8.1f} tok/s, step {row['step_ms']:.3f} ms,"
                  f" {row['x_dense']:.3f}x dense", flush=True)  # fmt: skip
    with open(own.out, "w") as f:
        json.dump({"model": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
