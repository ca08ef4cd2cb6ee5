"""Issue 34: the 1.5b decode step in the real generation path (bench_generate's calibrated model, compiled blocks,
CUDA graphs, fused q/k/v) per variant impl:tile:attention -- the FFN (dense or twell), the fused decode FFN's
units per program (64 / 32 / 16: d_ff / tile programs share its gate GEMV, 88 / 176 / 352 at d_ff 5632 on the
H200's 132 SMs) and the decode attention (sdpa or flash_decode).

    python docs/results/2026-12-05-c/decode_tiles.py out.json [--batch 1] [--variants dense:64:sdpa twell:32:sdpa]
"""

import argparse
import json
import sys

import torch
from bench_generate import build_model, parse_args, run_variant
from bench_model import set_ffn_impl

from twell.kernels.inference import decode_fused

DEFAULT = ["dense:64:sdpa", "twell:64:sdpa", "twell:32:sdpa", "twell:16:sdpa", "dense:64:flash_decode",
           "twell:32:flash_decode"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--variants", nargs="+", default=DEFAULT)
    p.add_argument("--new-tokens", type=int, default=64)
    own = p.parse_args()
    argv = [
        "--models",
        "1.5b",
        "--batch",
        *map(str, own.batch),
        "--new-tokens",
        str(own.new_tokens),
        "--repeats",
        "2",
    ]
    args = parse_args(argv)
    device = torch.device("cuda")
    model, name, _, prompts = build_model(args, "1.5b", device)
    rows = []
    for variant in own.variants:
        impl, tile, attention = variant.split(":")
        set_ffn_impl(model, impl)
        decode_fused.FUSED_TILE_N = int(tile)  # the default call's tile, read at each call
        args.attention = attention
        for batch in own.batch:
            row, _ = run_variant(model, prompts[:batch], args, device)
            rows.append({"variant": variant, **row})
            print(f"{variant:24s} batch {batch}: {row['decode_tok_s']:8.1f} tok/s, step {row['step_ms']:.3f} ms, "
                  f"TTFT {row['ttft_ms']:.2f} ms", flush=True)  # fmt: skip
            with open(own.out, "w") as f:
                json.dump({"model": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
