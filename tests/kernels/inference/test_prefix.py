import pytest
import torch

from twell.kernels.inference import prefix
from twell.kernels.inference.prefix import gated_up

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "M,P,D,F,dtype",
    [
        (67, 64, 128, 320, torch.bfloat16),
        (5, 128, 64, 192, torch.float32),
        (130, 320, 64, 320, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("loads", ["tma", "ptr"])
def test_gated_up_matches_reference(M, P, D, F, dtype, loads, poisoned_empty):
    """h[:, :P] * (x w_up[:P]^T) with odd M, P not a tile multiple (320 = 5 x 64) and P = F, through
    TMA descriptors (the Hopper path; the store clips to [M, P]) and pointer loads."""
    if loads == "tma" and DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    prefix.set_gated_up_loads(loads)
    gen = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 2**31, ()).item()))
    x = torch.randn(M, D, generator=gen, device=DEVICE).to(dtype)
    w = torch.randn(F, D, generator=gen, device=DEVICE).to(dtype)
    h = torch.relu(torch.randn(M, F, generator=gen, device=DEVICE)).to(dtype)
    try:
        out = gated_up(x, w, h, P)
    finally:
        prefix.set_gated_up_loads(None)
    assert out.shape == (M, P) and out.dtype == dtype
    ref = h[:, :P].double() * (x.double() @ w[:P].double().T)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # one rounding of the fp32 result
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("loads", [None, "ptr"])
def test_gated_up_at_paper_size(loads):
    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16) / 45
    h = torch.relu(torch.randn(16384, 5632, device="cuda", dtype=torch.bfloat16))
    prefix.set_gated_up_loads(loads)  # None: the device default (TMA on Hopper)
    try:
        out = gated_up(x, w, h, 512)
    finally:
        prefix.set_gated_up_loads(None)
    ref = h[:, :512].float() * (x.float() @ w[:512].float().T)
    assert ((out.float() - ref).norm(dim=1) / ref.norm(dim=1)).max() < 1e-2
