"""kernels/reinit.py: dead gate rows re-drawn in place by one kernel (Triton's interpreter on CPU)."""

import pytest
import torch

from twell.kernels.reinit import philox_seed, reinit_rows_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(R=96, D=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(R, D, generator=gen) * 0.05).to(DEVICE)
    moments = tuple(torch.rand(R, D, generator=gen).add_(0.5).to(DEVICE) for _ in range(2))
    dead = (torch.rand(R, generator=gen) < 0.3).to(DEVICE)
    dead[[0, R - 1]] = True  # the first and the last row (a partial last program)
    dead[1] = False
    return weight, moments, dead


def test_dead_rows_get_the_blend_with_normal_noise_and_nothing_else_moves():
    weight, moments, dead = _case()
    before = weight.clone()
    drawn = weight.clone()
    reinit_rows_(drawn, dead, seed=11, lam=1.0, sigma=1.0)  # lam 1, sigma 1: the noise itself
    z = drawn[dead]
    assert z.numel() > 5000
    assert abs(float(z.mean())) < 0.05 and float(z.std()) == pytest.approx(1.0, rel=0.05)
    assert torch.equal(drawn[~dead], before[~dead])
    reinit_rows_(weight, dead, seed=11, lam=0.1, sigma=0.02, moments=moments)
    torch.testing.assert_close(weight[dead], 0.9 * before[dead] + 0.002 * z, rtol=1e-6, atol=1e-7)
    assert torch.equal(weight[~dead], before[~dead])  # alive rows: not a bit changed
    for m in moments:
        assert torch.all(m[dead] == 0) and torch.all(m[~dead] >= 0.5)


def test_noise_is_a_function_of_the_seed_and_the_global_element():
    """The same seed draws the same numbers; another seed others; a shard of the rows, given their
    global indices, draws exactly the rows' part of the whole matrix's noise (FSDP2 shards)."""
    weight, _, dead = _case(R=64, D=128, seed=1)
    whole, again, other = weight.clone(), weight.clone(), weight.clone()
    reinit_rows_(whole, dead, seed=philox_seed(0, 7, 2), lam=0.5, sigma=0.02)
    reinit_rows_(again, dead, seed=philox_seed(0, 7, 2), lam=0.5, sigma=0.02)
    reinit_rows_(other, dead, seed=philox_seed(0, 8, 2), lam=0.5, sigma=0.02)
    assert torch.equal(whole, again)
    assert not torch.equal(whole[dead], other[dead])
    shard = weight[33:].clone()  # an uneven shard: rows 33..63
    rows = torch.arange(33, 64, device=DEVICE)
    reinit_rows_(shard, dead[33:].clone(), seed=philox_seed(0, 7, 2), lam=0.5, sigma=0.02, rows=rows)
    assert torch.equal(shard, whole[33:])


def test_no_dead_row_is_a_no_op_and_bad_arguments_are_named():
    weight, moments, dead = _case(R=16, D=64)
    before = [weight.clone(), *(m.clone() for m in moments)]
    reinit_rows_(weight, torch.zeros_like(dead), seed=3, lam=0.1, sigma=0.02, moments=moments)
    assert all(torch.equal(a, b) for a, b in zip((weight, *moments), before))
    with pytest.raises(ValueError, match=r"dead must be \[rows\]=16 flags"):
        reinit_rows_(weight, dead[:8], seed=3, lam=0.1, sigma=0.02)
    with pytest.raises(ValueError, match="at most 2 moments"):
        reinit_rows_(weight, dead, seed=3, lam=0.1, sigma=0.02, moments=(*moments, moments[0]))
    with pytest.raises(ValueError, match="does not match the weight"):
        reinit_rows_(weight, dead, seed=3, lam=0.1, sigma=0.02, moments=(moments[0][:8],))
