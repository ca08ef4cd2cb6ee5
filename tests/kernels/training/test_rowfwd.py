"""The row kernels (kernels/training/train_rowfwd.py) alone against float64 on one CSR.

Rows hold 0 to 19 entries, so the interpreter's config (CHUNK 8) walks rows of zero, one, a partial
and three steps. Each test runs twice: with the default long-row threshold (no row is long) and with
a threshold of 4, so that four rows are long: the interpreter's two long-row programs take the last
two listed, and the other two stay with their own programs.
"""

import pytest
import torch

from twell.kernels.training import train_rowfwd as rf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COUNTS = (0, 1, 5, 19, 9, 0, 13, 4)  # entries per row
D, F = 64, 40


def _csr(gen):
    """row_ptr, cols (sorted per row, distinct), gate > 0, x, w_up, w_down, w_gate (fp32)."""
    cols = [torch.randperm(F, generator=gen)[:n].sort().values for n in COUNTS]
    row_ptr = torch.tensor([0] + list(torch.tensor(COUNTS).cumsum(0)), dtype=torch.int32)
    cols = torch.cat(cols).to(torch.int32)
    gate = torch.rand(cols.numel(), generator=gen) + 0.1
    x, w_up, w_down, w_gate = (torch.randn(n, D, generator=gen) for n in (len(COUNTS), F, F, F))
    return [t.to(DEVICE) for t in (row_ptr, cols, gate, x, w_up, w_down, w_gate)]


@pytest.fixture(params=[rf.LONG_ROW, 4], ids=["plain", "long-rows"])
def long_row(request, monkeypatch):
    monkeypatch.setattr(rf, "LONG_ROW", request.param)
    return request.param


def _rows(row_ptr):
    return torch.repeat_interleave(
        torch.arange(len(COUNTS), device=row_ptr.device), torch.tensor(COUNTS).to(row_ptr.device)
    )


def test_forward_matches_float64(poisoned_empty, long_row):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    row_ptr, cols, gate, x, w_up, w_down, _ = _csr(gen)
    init = torch.randn(x.shape, generator=gen).to(DEVICE)
    l1_init = torch.rand(len(COUNTS), generator=gen).to(DEVICE)
    up, y, l1 = rf.row_ffn_forward(row_ptr, cols, gate, x, w_up, w_down, init=init, l1_init=l1_init)
    rows, c = _rows(row_ptr), cols.long()
    up_ref = (x.double()[rows] * w_up.double()[c]).sum(1)
    h = gate.double() * up_ref
    y_ref = init.double().index_add(0, rows, h[:, None] * w_down.double()[c])
    l1_ref = l1_init.double().index_add(0, rows, h.abs())
    torch.testing.assert_close(up.double(), up_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1.double(), l1_ref, rtol=1e-5, atol=1e-5)


def test_dx_matches_float64(poisoned_empty, long_row):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    row_ptr, cols, _, _, w_up, _, w_gate = _csr(gen)
    d_gate, d_up = (torch.randn(cols.numel(), generator=gen).to(DEVICE) for _ in range(2))
    dx = torch.empty(len(COUNTS), D, device=DEVICE)
    rf.row_dx(row_ptr, cols, d_gate, d_up, w_gate, w_up, dx)
    rows, c = _rows(row_ptr), cols.long()
    terms = d_gate.double()[:, None] * w_gate.double()[c] + d_up.double()[:, None] * w_up.double()[c]
    ref = torch.zeros(len(COUNTS), D, dtype=torch.float64, device=DEVICE).index_add(0, rows, terms)
    torch.testing.assert_close(dx.double(), ref, rtol=1e-5, atol=1e-5)


def test_inference_past_capacity_matches_float64(poisoned_empty, long_row):
    """A capacity that ends inside row 3 (and cuts rows 4-7 off entirely): their positives come from
    h, skipping the hot units that init already holds."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    row_ptr, cols, gate, x, w_up, w_down, _ = _csr(gen)
    rows, c = _rows(row_ptr), cols.long()
    h = torch.zeros(len(COUNTS), F, device=DEVICE)
    h[rows, c] = gate
    hot = torch.tensor([3, 17], device=DEVICE)
    hot_pos = torch.full((F,), -1, dtype=torch.int32, device=DEVICE)
    hot_pos[hot] = torch.arange(2, dtype=torch.int32, device=DEVICE)
    cold = hot_pos[c] < 0  # the CSR lists cold entries only (row_ptr over them)
    counts = torch.zeros(len(COUNTS), dtype=torch.int32, device=DEVICE).index_add(0, rows, cold.int())
    cold_ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0).int()])
    cap = int(cold_ptr[3]) + 2
    init = torch.randn(x.shape, generator=gen).to(DEVICE)
    y = rf.row_ffn_inference(cold_ptr, cols[cold][:cap].contiguous(), gate[cold][:cap].contiguous(), x, w_up,
                             w_down, h, hot_pos, init)  # fmt: skip
    hc = gate.double()[cold] * (x.double()[rows[cold]] * w_up.double()[c[cold]]).sum(1)
    ref = init.double().index_add(0, rows[cold], hc[:, None] * w_down.double()[c[cold]])
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_long_rows_lists_the_long_rows_and_serves_each_once(monkeypatch):
    """The list holds exactly the rows above the threshold, each at its slot; launches on one list give
    the same bits, which are those of the plain walk."""
    monkeypatch.setattr(rf, "LONG_ROW", 4)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    row_ptr, cols, gate, x, w_up, w_down, _ = _csr(gen)
    long = rf.long_rows(row_ptr)
    n = int(long.count[0])
    listed = long.rows[:n].tolist()
    assert sorted(listed) == [r for r, c in enumerate(COUNTS) if c > 4] and long.limit == 4
    assert [int(long.slots[r]) for r in listed] == list(range(n))
    outs = [rf.row_ffn_forward(row_ptr, cols, gate, x, w_up, w_down, long=long) for _ in range(2)]
    rf.set_long_rows(False)
    try:
        outs.append(rf.row_ffn_forward(row_ptr, cols, gate, x, w_up, w_down))
    finally:
        rf.set_long_rows(True)
    for up, y, l1 in outs[1:]:
        assert torch.equal(up, outs[0][0]) and torch.equal(y, outs[0][1]) and torch.equal(l1, outs[0][2])
