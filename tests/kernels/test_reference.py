import torch

from twell.kernels import reference
from twell.kernels.synthetic import make_rows_dense, make_rows_silent, paper_like_ffn_inputs


def _rand(M, D, F, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((M, D), (F, D), (F, D), (F, D))]


def test_relu_ffn_matches_the_gated_ffn_formula_and_counts():
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _rand(9, 64, 128, seed)
    out = reference.relu_ffn(x, wg, wu, wd)
    pre = x @ wg.T
    h = torch.where(pre > 0, pre, 0) * (x @ wu.T)
    torch.testing.assert_close(out.y, h @ wd)
    torch.testing.assert_close(out.l1, h.abs().sum(1).mean())
    assert out.row_active.dtype == torch.int32 and out.unit_fires.dtype == torch.int32
    assert out.row_active.tolist() == (pre > 0).sum(1).tolist()
    assert out.unit_fires.tolist() == (pre > 0).sum(0).tolist()
    assert out.overflow_rows.dim() == 0 and int(out.overflow_rows) == 0


def test_relu_ffn_is_differentiable_in_all_inputs():
    seed = int(torch.randint(0, 2**31, ()).item())
    args = [t[:, :8].contiguous().requires_grad_() for t in _rand(3, 8, 6, seed)]
    f = lambda *a: reference.relu_ffn(*a).y.sum() + reference.relu_ffn(*a).l1
    assert torch.autograd.gradcheck(f, args)


def test_synthetic_inputs_have_paper_like_activity():
    x, wg, _, _ = paper_like_ffn_inputs(4096, 256, 1024, mean_active=10.0, dtype=torch.float32, seed=3)
    active = (x @ wg.T) > 0
    per_row = active.sum(1).float()
    assert 8.0 < per_row.mean() < 12.0
    assert per_row.max() > 5 * per_row.mean()  # a long tail of dense rows
    dead = (active.sum(0) == 0).float().mean()
    assert 0.25 < dead < 0.35


def test_hard_pattern_helpers():
    x, wg, _, _ = paper_like_ffn_inputs(8, 128, 256, mean_active=8.0, dtype=torch.float32, seed=1)
    make_rows_silent(x, [0])
    make_rows_dense(x, [1])
    active = (x @ wg.T) > 0
    assert active[0].sum() == 0 and active[1].all()
