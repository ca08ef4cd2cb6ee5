"""kernels/inference/decode_attention.py against PyTorch's attention over the same cache and mask."""

import pytest
import torch
import torch.nn.functional as F

from twell.kernels.inference.decode_attention import decode_attention, decode_splits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, k, v, positions):
    L = k.shape[2]
    mask = (torch.arange(L, device=q.device) <= positions[:, None]).view(-1, 1, 1, L)
    H, HKV = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=H != HKV
    )
    return out


@pytest.mark.parametrize(
    "B,H,HKV,HD,L,splits",
    [
        (3, 4, 4, 64, 200, None),  # multi-head, several splits, a partial last block
        (2, 8, 2, 48, 96, 3),  # grouped-query (4 query heads a KV head), head_dim not a power of two
        (1, 2, 1, 32, 40, 1),  # one split
        (4, 2, 2, 64, 130, 5),  # more splits than some rows have keys for
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa_on_the_attended_slots(B, H, HKV, HD, L, splits, dtype):
    seed = int(torch.randint(0, 2**31, ()).item())
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, HD, generator=gen).transpose(1, 2)  # [B, H, 1, hd] as the model's view
    cache = torch.randn(2, B, HKV, L, HD, generator=gen) * 2
    # row 0 attends to slot 0 only, the last row to every slot, the others in between
    positions = torch.randint(0, L, (B,), generator=gen)
    positions[0], positions[-1] = 0, L - 1
    # slots past a row's position hold garbage a wrong kernel would read
    for b in range(B):
        cache[:, b, :, positions[b] + 1 :] = float("nan")
    q, k, v = (t.to(DEVICE, dtype) for t in (q, cache[0], cache[1]))
    positions = positions.to(DEVICE)
    out = decode_attention(q, k, v, positions, splits=splits)
    assert out.shape == (B, H, 1, HD) and out.dtype == dtype
    ref = _reference(q, torch.nan_to_num(k), torch.nan_to_num(v), positions)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


def test_splits_cover_the_gpu_at_small_batches_and_bad_shapes_are_named():
    assert decode_splits(1 * 32, 768) == 9  # batch 1, 32 KV heads: 288 programs
    assert decode_splits(64 * 32, 768) == 1
    assert decode_splits(1, 100) == 2  # no split under 64 slots
    q = torch.zeros(2, 4, 1, 64, device=DEVICE)
    k = torch.zeros(2, 3, 16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="H=4 a multiple of Hkv"):
        decode_attention(q, k, k, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="one query token per row"):
        decode_attention(q.expand(2, 4, 2, 64), k, k, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"positions must hold one slot per row \(\[2\]\)"):
        decode_attention(q, k[:, :2], k[:, :2], torch.zeros(3, dtype=torch.int64, device=DEVICE))
