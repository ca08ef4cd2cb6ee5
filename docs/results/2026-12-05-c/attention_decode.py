"""Issue 34: a decode step's attention per layer at the 1.5b shape (32 heads of 64, cache of 768 slots, each row
at position 640 +- 100), PyTorch's scaled_dot_product_attention under the cache mask (what Attention runs) against
kernels/inference/decode_attention.py, 8 layers on their own caches in one CUDA graph (benchlib.timed_layers),
batches 1 / 8 / 64; outputs checked against an fp64 reference.

    python docs/results/2026-12-05-c/attention_decode.py out.json
"""

import json
import sys

import torch
import torch.nn.functional as F
from benchlib import timed_layers

from twell.kernels.inference.decode_attention import decode_attention

H, HD, L, LAYERS = 32, 64, 768, 8


def bench(B: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(B)
    q = torch.randn(B, H, 1, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    caches = [
        torch.randn(2, B, H, L, HD, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(LAYERS)
    ]
    pos = (640 + torch.randint(-100, 100, (B,), device="cuda", generator=gen)).clamp(max=L - 1)
    mask = (torch.arange(L, device="cuda") <= pos[:, None]).view(B, 1, 1, L)

    def sdpa(i):
        return F.scaled_dot_product_attention(q, caches[i][0], caches[i][1], attn_mask=mask)

    def ours(i):
        return decode_attention(q, caches[i][0], caches[i][1], pos)

    ref = F.scaled_dot_product_attention(
        q.double(), caches[0][0].double(), caches[0][1].double(), attn_mask=mask
    )
    calls = {"sdpa": sdpa, "flash_decode": ours}
    err = {n: float((f(0).double() - ref).abs().max()) for n, f in calls.items()}
    ms = {n: timed_layers(f, LAYERS, 200) for n, f in calls.items()}
    kv_bytes = 2 * float((pos + 1).sum()) * H * HD * 2
    return dict(batch=B, sdpa_us=ms["sdpa"] * 1e3, flash_decode_us=ms["flash_decode"] * 1e3,
                speedup=ms["sdpa"] / ms["flash_decode"], max_err=err,
                flash_decode_gbs=kv_bytes / (ms["flash_decode"] * 1e6))  # fmt: skip


def main() -> None:
    rows = []
    for B in (1, 8, 64):
        row = bench(B)
        rows.append(row)
        print(f"batch {B:3d}: sdpa {row['sdpa_us']:7.2f} us, flash_decode {row['flash_decode_us']:7.2f} us "
              f"({row['speedup']:.2f}x, {row['flash_decode_gbs']:.0f} GB/s of attended KV), max err {row['max_err']}",
              flush=True)  # fmt: skip
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
