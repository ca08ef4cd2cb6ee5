import pytest
import torch

from twell.kernels import twell_gate
from twell.kernels.bitmask import count_fires, pack_positive_bits, select_hot_units
from twell.kernels.gate import relu_gate_bits, set_gate_variant, twell_gate_hot
from twell.kernels.gate_gemm import launch_relu_bits_persistent
from twell.kernels.synthetic import make_rows_dense, make_units_always_active, paper_like_ffn_inputs


def _check_format(x, w_gate, g, exclude=None):
    """Counts are the true positives per (row, tile); the stored entries are the first min(count, S)
    positive columns in order, with their gate values. exclude: [F] bool columns that must not appear
    (the hot units of twell_gate_hot)."""
    pre = x.double() @ w_gate.double().T
    M, F = pre.shape
    T = -(-F // g.tile_n)
    assert g.counts.shape == (M, T) and g.cols.shape == (M, T, g.slots) == g.vals.shape
    # Pre-activations within rounding of 0 may land on either side in another summation order.
    ambiguous = pre.abs() < 1e-3 * pre.abs().max()
    pos = pre > 0
    if exclude is not None:
        pos &= ~exclude
        ambiguous &= ~exclude
    for m in range(M):
        for t in range(T):
            lo, hi = t * g.tile_n, min(F, (t + 1) * g.tile_n)
            count = int(g.counts[m, t])
            sure = int(pos[m, lo:hi].sum())
            slack = int(ambiguous[m, lo:hi].sum())
            assert abs(count - sure) <= slack, (m, t, count, sure)
            n = min(count, g.slots)
            cols = g.cols[m, t, :n].long()
            assert bool((cols >= lo).all() and (cols < hi).all()) and bool((cols[1:] > cols[:-1]).all())
            assert bool((pos[m, cols] | ambiguous[m, cols]).all())
            if slack == 0:
                expected = torch.nonzero(pos[m, lo:hi]).flatten()[:n] + lo
                assert cols.tolist() == expected.tolist()
            torch.testing.assert_close(
                g.vals[m, t, :n].double(), pre[m, cols].clamp(min=0), rtol=2e-2, atol=1e-2
            )


@pytest.mark.parametrize(
    "M,D,F,dtype", [(1, 64, 192, torch.float32), (67, 128, 320, torch.bfloat16), (7, 64, 128, torch.float32)]
)
@pytest.mark.parametrize("loads", ["tma", "ptr"])
def test_gate_format_is_exact(M, D, F, dtype, loads, poisoned_empty):
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, _, _ = paper_like_ffn_inputs(M, D, F, mean_active=F / 40, dtype=dtype, seed=seed)
    make_rows_dense(x, [M // 2])
    set_gate_variant(loads=loads)  # under the interpreter: 32-column compaction steps in 64-wide tiles
    try:
        _check_format(x, wg, twell_gate(x, wg))
    finally:
        set_gate_variant()


@pytest.mark.parametrize("M,F,dtype", [(67, 320, torch.bfloat16), (65, 192, torch.float32)])
@pytest.mark.parametrize(
    "path,sub_n,compact",
    [("fused", 64, None), ("fused", 16, None), ("two_kernel", None, "bits"), ("two_kernel", None, "scan")],
)
def test_gate_paths_give_the_same_format(M, F, dtype, path, sub_n, compact, poisoned_empty):
    """Every compaction variant (one step per tile, 4 steps, dense pass + bitmask or scanning
    compaction kernel) is exact."""
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, _, _ = paper_like_ffn_inputs(M, 64, F, mean_active=F / 20, dtype=dtype, seed=seed)
    make_rows_dense(x, [M // 3])
    set_gate_variant(path=path, sub_n=sub_n, compact=compact)
    try:
        _check_format(x, wg, twell_gate(x, wg))
    finally:
        set_gate_variant()


def test_gate_counts_past_the_slots_on_overflow(poisoned_empty):
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, _, _ = paper_like_ffn_inputs(33, 64, 192, mean_active=4.0, dtype=torch.float32, seed=seed)
    make_units_always_active(wg, slice(64, 128))  # the whole second tile fires on every row
    g = twell_gate(x, wg, slots=8, tile_n=64)
    assert bool((g.counts[:, 1] >= 60).all())  # true counts, far past the 8 slots
    _check_format(x, wg, g)


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((4, 100), (64, 100)), "d_model=100 must be a multiple of 64"),
        (((4, 64), (100, 64)), "d_ff=100 must be a multiple of 64"),
        (((4, 64), (64, 128)), "w_gate has d_model=128 but x has d_model=64"),
        (((0, 64), (64, 64)), "at least one token"),
    ],
)
def test_gate_rejects_bad_shapes(shapes, match):
    x, w = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    with pytest.raises(ValueError, match=match):
        twell_gate(x, w)


def test_gate_rejects_bad_dtype_layout_and_options():
    x, w = torch.randn(4, 64), torch.randn(64, 64)
    with pytest.raises(ValueError, match="w_gate.dtype=torch.bfloat16 differs"):
        twell_gate(x, w.bfloat16())
    with pytest.raises(ValueError, match="int32 is not supported"):
        twell_gate(x.int(), w.int())
    with pytest.raises(ValueError, match="must be contiguous"):
        twell_gate(torch.randn(64, 4).T, w)
    with pytest.raises(ValueError, match="tile_n=96 is not supported"):
        twell_gate(x, w, tile_n=96)
    with pytest.raises(ValueError, match="slots=0 must be in"):
        twell_gate(x, w, slots=0)


@pytest.mark.gpu
def test_gate_format_at_paper_size():
    x, wg, _, _ = paper_like_ffn_inputs(16384, 2048, 5632, device="cuda", seed=11)
    for M in (16384, 64):  # the GEMM and the decode GEMV regimes
        g = twell_gate(x[:M], wg)
        pre = (x[:M].float() @ wg.float().T).view(M, -1, g.tile_n)
        ambiguous = (pre.abs() < 1e-2).sum(-1)
        assert bool(((g.counts - (pre > 0).sum(-1)).abs() <= ambiguous).all())


@pytest.mark.gpu
@pytest.mark.parametrize("M", [16384, 4099])
def test_count_fires_at_paper_size(M):
    """count_fires on the GPU: every unit's count equals the positives of h, at the paper's width, for a
    whole and a ragged batch, call after call."""
    x, wg, _, _ = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=M)
    make_rows_dense(x, [M // 2])
    h, bits = relu_gate_bits(x, wg)
    fires = count_fires(bits)
    assert torch.equal(fires, (h > 0).sum(0, dtype=torch.int32))
    assert torch.equal(count_fires(bits), fires)


@pytest.mark.parametrize("compact", ["bits", "scan"])
@pytest.mark.parametrize("M,F,K", [(67, 320, 64), (9, 192, 192)])
def test_hot_gate_splits_columns_exactly(M, F, K, compact, poisoned_empty):
    """twell_gate_hot: g_hot holds relu(pre) of every hot column (zeros included); the TwELL part
    holds the cold positives only, with counts of cold positives (overflow decided on cold ones)."""
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, _, _ = paper_like_ffn_inputs(M, 64, F, mean_active=F / 20, dtype=torch.float32, seed=seed)
    make_rows_dense(x, [M // 3])
    set_gate_variant(compact=compact)
    try:
        hot = twell_gate_hot(x, wg, K, slots=8, tile_n=64)
    finally:
        set_gate_variant()
    pre = x.double() @ wg.double().T
    assert hot.hot_idx.shape == (K,) and bool((hot.hot_idx[1:] > hot.hot_idx[:-1]).all())
    torch.testing.assert_close(hot.g_hot.double(), pre[:, hot.hot_idx].clamp(min=0), rtol=1e-4, atol=1e-5)
    cold = torch.ones(F, dtype=torch.bool)
    cold[hot.hot_idx] = False
    assert bool((hot.hot_pos[hot.hot_idx] == torch.arange(K)).all()) and bool((hot.hot_pos[cold] == -1).all())
    _check_format(x, wg, hot.gate, exclude=~cold)
    # The hot set is the K most frequent units of the whole batch (exact counts from the GEMM epilogue).
    fires, near_zero = (pre > 0).sum(0), (pre.abs() < 1e-4).sum(0)  # fp32 may flip a sign near zero
    if K < F:
        assert int((fires + near_zero)[hot.hot_idx].min()) >= int((fires - near_zero)[cold].max())


@pytest.mark.parametrize("F,K", [(128, 1), (192, 37), (320, 320), (1000, 64)])
def test_select_hot_units_takes_the_k_largest_counts_lowest_column_first(F, K, poisoned_empty):
    """Heavy ties (counts from a tiny range) and all-equal counts: exactly K units, every unit above the
    K-th count, ties broken by lower column, hot_idx ascending, hot_pos its inverse."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    for fires in (
        torch.randint(0, 5, (F,), generator=gen),
        torch.full((F,), 7),
        torch.randint(0, 10**6, (F,), generator=gen),
    ):
        fires = fires.to(torch.int32)
        hot_idx, hot_pos, hot_bits = select_hot_units(fires, K)
        # reference: stable sort by count descending, then lower column first
        order = sorted(range(F), key=lambda c: (-int(fires[c]), c))[:K]
        assert hot_idx.tolist() == sorted(order)
        expect = torch.full((F,), -1, dtype=torch.int32)
        expect[hot_idx] = torch.arange(K, dtype=torch.int32)
        assert torch.equal(hot_pos, expect)
        hot = torch.zeros(-(-F // 32) * 32, dtype=torch.int64)
        hot[hot_idx] = 1
        words = (hot.view(-1, 32) << torch.arange(32)).sum(1)
        assert torch.equal(hot_bits, torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))


@pytest.mark.parametrize("M,W,full", [(1, 2, 0), (37, 6, 0), (300, 11, 0), (131, 3, 131)])
def test_count_fires_counts_every_set_bit(M, W, full, poisoned_empty):
    """Random words, a row with every bit set (sign bit included) and, last case, every bit of every
    row set: counts past each 31-row group of the bit-sliced sum carry over."""
    bits = torch.randint(-(2**31), 2**31, (M, W), dtype=torch.int64).to(torch.int32)
    bits[: max(full, 1)] = -1
    unpacked = (bits.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1
    assert torch.equal(count_fires(bits), unpacked.sum(0).view(-1).to(torch.int32))


@pytest.mark.parametrize(
    "M,D,F,dtype",
    [(100, 128, 320, torch.float32), (37, 64, 192, torch.bfloat16), (260, 192, 128, torch.float32)],
)
def test_persistent_relu_bits_gemm_matches_torch(M, D, F, dtype, poisoned_empty):
    """The persistent dense_bits GEMM (several tiles per program, partial row and column tiles, TMA
    stores) writes relu(x w^T) and exactly its positive bitmask, also through relu_gate_bits."""
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, _, _ = paper_like_ffn_inputs(M, D, F, mean_active=F / 20, dtype=dtype, seed=seed)
    make_rows_dense(x, [M // 3])
    h = torch.full((M, F), float("nan"), dtype=dtype)
    bits = torch.full((M, F // 32), 0x5A5A5A5A, dtype=torch.int32)
    launch_relu_bits_persistent(x, wg, h, bits)
    ref = torch.relu(x.double() @ wg.double().T)
    torch.testing.assert_close(h.double(), ref, rtol=2e-2, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(bits, pack_positive_bits(h))
    set_gate_variant(bits_gemm="persistent")
    try:
        h2, bits2 = relu_gate_bits(x, wg)
    finally:
        set_gate_variant()
    assert torch.equal(h2, h) and torch.equal(bits2, bits)
    with pytest.raises(ValueError, match="bits_gemm='fast' must be"):
        set_gate_variant(bits_gemm="fast")
