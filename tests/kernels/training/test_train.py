"""twell_ffn (the training op) against a float64 PyTorch reference: outputs, all four gradients, the L1
gradient, dense and silent rows, the CSR build, saved memory, torch.compile, autocast, checkpointing and bad inputs.

CPU runs the Triton kernels under the interpreter (small shapes); the GPU tests run the paper's sizes.
"""

from __future__ import annotations

import pytest
import torch

from twell.kernels.reference import relu_ffn
from twell.kernels.synthetic import (
    make_rows_dense,
    make_rows_heavy_tailed,
    make_rows_silent,
    make_units_always_active,
    paper_like_ffn_inputs,
)
from twell.kernels.training import train_format, train_sparse
from twell.kernels.training.train import (
    BACKWARD_VARIANTS,
    hot_units_for,
    set_backward_variant,
    set_hot_units,
    set_streams,
    twell_ffn,
)
from twell.kernels.training.train_sparse import ONE, SPLIT2, SPLIT3, entry_grads, segment_axpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _inputs(M, D, F, dtype, mean_active=6.0, seed=None):
    seed = _fresh_seed() if seed is None else seed
    return list(
        paper_like_ffn_inputs(M, D, F, mean_active=mean_active, dtype=dtype, device=DEVICE, seed=seed)
    )


def _run(fn, inputs, grad_y, l1_coef, dtype=None):
    """Outputs and the gradients of sum(y * grad_y) + l1_coef * l1 w.r.t. the four inputs."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    loss = (out.y.to(grad_y.dtype) * grad_y).sum() + l1_coef * out.l1
    loss.backward()
    return out, [t.grad for t in leaves]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check_against_reference(inputs, l1_coef=None, tol=1e-5):
    """Ours vs float64; in 16-bit, also no worse than 3x the error of a dense FFN in the same dtype."""
    dtype = inputs[0].dtype
    M, D = inputs[0].shape
    l1_coef = float(torch.rand(()) * 2 + 0.1) if l1_coef is None else l1_coef
    grad_y = torch.randn(M, D, device=DEVICE, dtype=torch.float64)
    out, grads = _run(twell_ffn, inputs, grad_y.to(dtype), l1_coef)
    ref, ref_grads = _run(relu_ffn, inputs, grad_y, l1_coef, dtype=torch.float64)
    if dtype == torch.float32:
        assert torch.equal(out.row_active, ref.row_active)
        assert torch.equal(out.unit_fires, ref.unit_fires)
        bounds = [tol] * 6
    else:
        dense, dense_grads = _run(relu_ffn, inputs, grad_y.to(dtype), l1_coef)
        rounding = [
            _rel_err(a, b) for a, b in zip([dense.y, dense.l1, *dense_grads], [ref.y, ref.l1, *ref_grads])
        ]
        # Floor 1e-2 (~2.5 bf16 ulps; the "rounding level"). The CPU interpreter truncates
        # fp32 -> bf16 instead of rounding to nearest, a bias of ~half an ulp on every stored value, and
        # y is stored twice with hot units (y_hot, then y): on rows where the hot and cold shares cancel
        # (the dense rows of these tiny shapes) that reached 1.2e-2 in ~1 of 25 draws, hence 1.5e-2 there.
        floor = 1.5e-2 if DEVICE == "cpu" else 1e-2
        bounds = [max(3 * r, floor) for r in rounding]
        assert max(bounds) < 5e-2, f"dense {dtype} reference itself is far off: {rounding}"
        # A pre-activation within rounding of 0 may flip; anything more is a wrong pattern.
        assert (out.row_active - ref.row_active).abs().sum() <= max(2, M // 20)
    names = ["y", "l1", "dx", "dw_gate", "dw_up", "dw_down"]
    for name, a, b, bound in zip(names, [out.y, out.l1, *grads], [ref.y, ref.l1, *ref_grads], bounds):
        assert a.dtype == (torch.float32 if name == "l1" else dtype)
        err = _rel_err(a, b)
        assert err <= bound, f"{name}: relative error {err:.2e} > {bound:.2e} ({dtype}, M={M})"
    return out


@pytest.mark.parametrize("M", [1, 7, 67])
def test_fp32_matches_reference_at_odd_sizes(M):
    out = _check_against_reference(_inputs(M, 64, 320, torch.float32))
    assert out.y.shape == (M, 64) and out.row_active.shape == (M,) and out.unit_fires.shape == (320,)


def test_bf16_at_rounding_level():
    _check_against_reference(_inputs(53, 128, 256, torch.bfloat16, mean_active=8.0))


def test_hard_patterns_dense_silent_and_heavy_tailed_rows():
    M, D, F = 40, 64, 256
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32)
    make_rows_dense(x, [0, 17])  # every unit fires: rows as long as d_ff in the CSR
    make_rows_silent(x, [1, 2, 39])  # nothing fires
    make_rows_heavy_tailed(x, list(range(20, 30)), seed=_fresh_seed())
    out = _check_against_reference([x, w_gate, w_up, w_down])
    assert out.row_active[[1, 2, 39]].eq(0).all() and out.row_active[[0, 17]].gt(F // 4).all()
    assert int(out.overflow_rows) == 0  # the training CSR holds every positive: nothing overflows


def test_every_unit_firing_on_every_row():
    M, D, F = 19, 64, 192
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32)
    make_units_always_active(w_gate, list(range(F)))
    out = _check_against_reference([x, w_gate, w_up, w_down])
    assert out.row_active.eq(F).all() and int(out.overflow_rows) == 0


def test_some_units_firing_on_every_row():
    M, D, F = 9, 64, 128
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32)
    make_rows_silent(x, list(range(M)))
    make_units_always_active(w_gate, list(range(32)) + list(range(64, 67)))  # a whole word, then 3
    out = _check_against_reference([x, w_gate, w_up, w_down])
    assert out.row_active.eq(35).all()


def test_l1_gradient_alone_and_y_alone():
    inputs = _inputs(23, 64, 256, torch.float32)
    coef = float(torch.rand(()) + 0.5)
    # Only the L1 term: grad_y never reaches backward (None), the gradient is coef * sign(h) / M paths.
    leaves = [t.clone().requires_grad_() for t in inputs]
    (coef * twell_ffn(*leaves).l1).backward()
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    (coef * relu_ffn(*ref_leaves).l1).backward()
    for a, b in zip(leaves[:3], ref_leaves[:3]):
        assert _rel_err(a.grad, b.grad) < 1e-5
    assert ref_leaves[3].grad is None and leaves[3].grad.abs().max() == 0  # L1 does not depend on w_down
    # Only y: grad_l1 is None.
    leaves = [t.clone().requires_grad_() for t in inputs]
    twell_ffn(*leaves).y.sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    relu_ffn(*ref_leaves).y.sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert _rel_err(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("variant", BACKWARD_VARIANTS + ("auto",))
def test_backward_variants_agree_and_are_deterministic(variant):
    inputs = _inputs(31, 64, 256, torch.float32)
    make_rows_dense(inputs[0], [4])  # a dense row too
    grad_y = torch.randn(31, 64, device=DEVICE)
    try:
        set_backward_variant(variant)
        first = _run(twell_ffn, inputs, grad_y, 0.7)
        second = _run(twell_ffn, inputs, grad_y, 0.7)
    finally:
        set_backward_variant("auto")
    assert torch.equal(first[0].y, second[0].y)
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)  # no atomics: bit-identical re-runs (activation checkpointing relies on it)
    ref = _run(relu_ffn, inputs, grad_y.double(), 0.7, dtype=torch.float64)
    for a, b in zip(first[1], ref[1]):
        assert _rel_err(a, b) < 1e-5


def test_saves_only_sparse_state_for_backward():
    M, D, F = 48, 64, 256
    inputs = [t.requires_grad_() for t in _inputs(M, D, F, torch.float32)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = twell_ffn(*inputs)
    input_ptrs = {t.data_ptr() for t in inputs}
    extra = [t for t in saved if t.data_ptr() not in input_ptrs]
    assert extra, "backward state must be saved"
    nnz = int(out.row_active.sum())
    for t in extra:  # nothing [M, F]-sized: per entry or per row only
        assert t.numel() <= max(nnz, M + 1), f"saved a tensor of shape {tuple(t.shape)} (nnz={nnz})"


def test_checkpointing_recomputes_the_same_gradients():
    inputs = _inputs(21, 64, 192, torch.float32)
    grad_y = torch.randn(21, 64, device=DEVICE)

    def ffn_loss(*ts):
        out = twell_ffn(*ts)
        return (out.y * grad_y).sum() + 0.3 * out.l1

    plain = [t.clone().requires_grad_() for t in inputs]
    ffn_loss(*plain).backward()
    ckpt = [t.clone().requires_grad_() for t in inputs]
    torch.utils.checkpoint.checkpoint(ffn_loss, *ckpt, use_reentrant=False).backward()
    for a, b in zip(plain, ckpt):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_selective_checkpointing_keeps_the_op_outputs_instead_of_running_it_again(op_forward_calls, compiled):
    """Under checkpoint_context the recomputed forward takes the op's kept outputs: the op runs once per
    forward and backward (plain checkpointing: twice), with the same gradients as no checkpointing."""
    import twell.kernels.training.train as kt

    calls = op_forward_calls
    inputs = _inputs(19, 64, 192, torch.float32)
    grad_y = torch.randn(19, 64, device=DEVICE)

    def ffn_loss(*ts):
        out = twell_ffn(torch.tanh(ts[0]), *ts[1:])  # an op before it, which is recomputed
        return (out.y * grad_y).sum() + 0.3 * out.l1

    def grads(**options):
        def step(*leaves):
            if options.get("checkpointed"):
                kw = {"context_fn": kt.checkpoint_context} if options.get("selective") else {}
                return torch.utils.checkpoint.checkpoint(ffn_loss, *leaves, use_reentrant=False, **kw)
            return ffn_loss(*leaves)

        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
        calls.clear()
        leaves = [t.clone().requires_grad_() for t in inputs]
        step(*leaves).backward()
        return len(calls), [t.grad for t in leaves]

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        plain_calls, plain = grads()
        ac_calls, ac = grads(checkpointed=True)
        sac_calls, sac = grads(checkpointed=True, selective=True)
    assert (plain_calls, ac_calls, sac_calls) == (1, 2, 1)
    for a, b, c in zip(plain, ac, sac):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_autocast_reaches_fp32_master_weights():
    M, D, F = 16, 64, 128
    inputs = _inputs(M, D, F, torch.float32)

    def grads(fn, dtype=None, autocast=False):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            out = fn(*leaves)
            loss = out.y.double().sum() + out.l1
        loss.backward()
        return out, [t.grad for t in leaves]

    out, ours = grads(twell_ffn, autocast=True)
    assert out.y.dtype == torch.bfloat16
    _, dense = grads(relu_ffn, autocast=True)  # the rounding level of a dense FFN under autocast
    _, exact = grads(relu_ffn, dtype=torch.float64)
    for a, d, b in zip(ours, dense, exact):
        assert a.dtype == torch.float32
        assert _rel_err(a, b) <= max(3 * _rel_err(d, b), 1e-2)


def test_compiles_without_graph_breaks():
    inputs = _inputs(12, 64, 128, torch.float32)
    grad_y = torch.randn(12, 64, device=DEVICE)

    def step(x, wg, wu, wd):
        out = twell_ffn(torch.tanh(x) * 2, wg, wu, wd)  # ops around the custom op stay in one graph
        return (out.y * grad_y).sum() + 0.5 * out.l1, out.row_active.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    leaves = [t.clone().requires_grad_() for t in inputs]
    loss, active = compiled(*leaves)
    loss.backward()
    eager = [t.clone().requires_grad_() for t in inputs]
    eager_loss, eager_active = step(*eager)
    eager_loss.backward()
    assert torch.allclose(loss, eager_loss, rtol=1e-6) and torch.equal(active, eager_active)
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad)


def test_custom_ops_pass_opcheck():
    import twell.kernels.training.train as kt

    inputs = [t.requires_grad_() for t in _inputs(10, 64, 128, torch.float32)]
    key = inputs[1]  # the layer's w_gate keys its entry-count history
    test_utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    # (hot units, capacity in the layer's history, sizes): no history: exact sizes; 8: far too few entry
    # slots (the op redoes the call exactly); 4096: fits; static: the capacity as a fixed size
    cases = (
        (0, 0, "estimate"),
        (16, 0, "estimate"),
        (0, 8, "estimate"),
        (16, 4096, "estimate"),
        (0, 4096, "static"),
        (0, 8, "late"),
        (16, 4096, "late"),
    )
    try:
        for hot, capacity, sizes in cases:
            kt.forget_sizes([key])
            if capacity:
                kt._capacities[key] = {(10, hot): capacity}
            kt.set_sizes(sizes)
            torch.library.opcheck(
                torch.ops.twell.ffn_train_fwd.default, (*inputs, key, hot), test_utils=test_utils
            )
    finally:
        kt.set_sizes("estimate")


@pytest.mark.parametrize("mode", [ONE, SPLIT2, SPLIT3])
def test_segment_sums_split_long_segments_exactly(mode):
    # Segments of 0 .. 40 entries with chunk 8: empty, single-chunk and many-chunk segments (a hot unit).
    n_seg, n_src, D = 11, 13, 64
    lengths = torch.randint(0, 12, (n_seg,))
    lengths[torch.randint(0, n_seg, (2,))] = torch.tensor([0, 40])
    seg_ptr = torch.zeros(n_seg + 1, dtype=torch.int32)
    seg_ptr[1:] = lengths.cumsum(0)
    nnz = int(seg_ptr[-1])
    gidx = torch.randint(0, n_src, (nnz,), dtype=torch.int32)
    coefs = tuple(torch.randn(nnz) for _ in range(3))
    sources = (torch.randn(n_src, D), torch.randn(max(n_src, n_seg), D))
    owner = torch.repeat_interleave(torch.arange(n_seg), lengths)

    def seg_sum(coef, src):
        gathered = coef.double()[:, None] * src.double()[gidx.long()]
        return torch.zeros(n_seg, D, dtype=torch.float64).index_add_(0, owner, gathered)

    if mode == ONE:
        expected, used = [seg_sum(coefs[0], sources[0])], (coefs[:1], sources[:1])
    elif mode == SPLIT2:  # two coefficients over the same gathered rows (dW_gate, dW_up)
        expected = [seg_sum(coefs[0], sources[0]), seg_sum(coefs[1], sources[0])]
        used = (coefs[:2], sources[:1])
    else:  # SPLIT3
        expected = [
            seg_sum(coefs[0], sources[0]),
            seg_sum(coefs[1], sources[0]),
            seg_sum(coefs[2], sources[1]),
        ]
        used = (coefs, sources)
    outs = tuple(torch.full((n_seg, D), float("nan"), device=DEVICE) for _ in expected)  # poisoned
    on_device = [tuple(t.to(DEVICE) for t in group) for group in used]
    segment_axpy(seg_ptr.to(DEVICE), gidx.to(DEVICE), *on_device, outs, mode, chunk=8)
    for out, ref in zip(outs, expected):
        torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_length_bucket_tuning_builds_columns_of_each_bucket_length(monkeypatch):
    """tune_length_buckets runs segment_axpy on columns exactly `bucket` entries long, so the call it
    makes is keyed by that very bucket (what warm_up relies on to tune each one before a run)."""
    seen = []
    real = train_sparse.segment_axpy

    def spy(seg_ptr, gidx, coefs, sources, outs, mode, chunk=512):
        n_seg = outs[0].shape[0]
        seen.append((train_sparse._length_bucket(gidx.numel(), n_seg), mode, len(coefs), len(sources)))
        assert torch.equal(
            seg_ptr.diff(), torch.full((n_seg,), seen[-1][0], dtype=torch.int32, device=DEVICE)
        )
        real(seg_ptr, gidx, coefs, sources, outs, mode, chunk)

    monkeypatch.setattr(train_sparse, "segment_axpy", spy)
    train_sparse.tune_length_buckets(3, 16, 8, SPLIT3, DEVICE, torch.float32, chunk=4, buckets=(1, 2, 8))
    train_sparse.tune_length_buckets(3, 16, 8, ONE, DEVICE, torch.float32, chunk=4, buckets=(4,))
    assert seen == [(1, SPLIT3, 3, 2), (2, SPLIT3, 3, 2), (8, SPLIT3, 3, 2), (4, ONE, 1, 1)]
    assert train_sparse.LEN_BUCKETS[-1] == train_sparse._length_bucket(10**9, 1)


@pytest.mark.gpu
def test_warm_up_tunes_every_column_length_bucket_on_gpu():
    """After kernels.train.warm_up no mean-column-length bucket of the column pass is left to be timed
    mid-run (each cost ~4 s of stall when first met by a training run)."""
    from twell.kernels.training.train import warm_up

    warm_up(16384, 2048, 5632, "cuda")
    tuned = {key[:3] for key in train_sparse._segment_axpy_kernel.cache}
    assert {(2048, SPLIT3, bucket) for bucket in train_sparse.LEN_BUCKETS} <= tuned


def test_work_list_kernel_matches_the_torch_build(monkeypatch):
    """The single-program work list (item and partial pointers, item -> segment) equals the torch-op
    build used past WORK_LIST_MAX_SEGMENTS, on empty, short and multi-chunk segments."""
    import twell.kernels.training.train_sparse as ts

    lens = torch.tensor([0, 3, 17, 0, 40, 8, 1, 33], dtype=torch.int32)
    seg_ptr = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)]).to(DEVICE)
    chunk, n_seg = 8, lens.numel()
    max_items = n_seg + int(lens.sum()) // chunk + 1
    max_split = int(lens.sum()) // chunk
    fast = ts._work_list(seg_ptr, n_seg, chunk, max_items, max_split)
    monkeypatch.setattr(ts, "WORK_LIST_MAX_SEGMENTS", 0)
    slow = ts._work_list(seg_ptr, n_seg, chunk, max_items, max_split)
    for a, b in zip(fast[:3], slow[:3]):
        assert torch.equal(a.cpu(), b.cpu())
    assert fast[0].tolist() == [0, 1, 2, 5, 6, 11, 12, 13, 18]  # ceil(len / 8), at least 1
    for split in (fast[3].cpu(), slow[3].cpu()):  # the segments of more than one chunk, then their count
        assert split[:3].tolist() == [2, 4, 7] and int(split[max_split]) == 3


def _random_gate(M, F, gen, density=0.05):
    """h (fp32 [M, F], zeros where not positive) with a few dense and silent rows, and its bitmask."""
    from twell.kernels.bitmask import pack_positive_bits

    h = torch.rand(M, F, generator=gen) + 0.5
    keep = torch.rand(M, F, generator=gen) < density
    keep[torch.randperm(M, generator=gen)[:3]] = True  # dense rows: all F positives
    keep[torch.randperm(M, generator=gen)[:3]] = False  # silent rows
    h = h * keep
    return h, pack_positive_bits(h)


def _torch_pattern(h, hot_idx=None):
    """(row_ptr, rows, cols, gate, row_active, g_hot) of h's positives built with torch ops."""
    cold = h.clone()
    g_hot = None
    if hot_idx is not None:
        g_hot = h[:, hot_idx]
        cold[:, hot_idx] = 0
    rows, cols = cold.nonzero(as_tuple=True)  # row-major, columns ascending
    row_ptr = torch.zeros(h.shape[0] + 1, dtype=torch.int64)
    row_ptr[1:] = (cold > 0).sum(1).cumsum(0)
    return row_ptr, rows, cols, cold[rows, cols], (h > 0).sum(1), g_hot


@pytest.mark.parametrize("hot", [0, 37])
def test_build_pattern_matches_a_torch_build_over_many_programs(hot):
    """The row scan (row_active, row_ptr, the entry total by atomics over many programs), the CSR and
    the hot split against the same quantities built with torch ops, dense and silent rows included."""
    from twell.kernels.bitmask import pack_positive_bits, select_hot_units
    from twell.kernels.training.train_format import build_pattern

    M, F = 300, 320
    gen = torch.Generator().manual_seed(_fresh_seed())
    h, bits = _random_gate(M, F, gen)
    assert torch.equal(bits, pack_positive_bits(h))
    split, hot_idx = None, None
    if hot:
        hot_idx, hot_pos, hot_bits = select_hot_units((h > 0).sum(0, dtype=torch.int32).to(DEVICE), hot)
        g_hot = torch.full((M, hot), float("nan"), device=DEVICE)  # poisoned: the compaction writes it whole
        split, hot_idx = (hot_pos, hot_bits, g_hot), hot_idx.cpu()
    pat = build_pattern(h.to(DEVICE), bits.to(DEVICE), split)
    row_ptr, rows, cols, gate, row_active, g_hot_ref = _torch_pattern(h, hot_idx)
    assert pat.pending is None and pat.totals.cpu().tolist() == [0, rows.numel()]
    assert pat.row_ptr.cpu().tolist() == row_ptr.tolist()
    assert torch.equal(pat.row_active.cpu(), row_active.to(torch.int32))
    assert torch.equal(pat.rows.cpu(), rows.to(torch.int32))
    assert torch.equal(pat.cols.cpu(), cols.to(torch.int32))
    assert torch.equal(pat.gate.cpu(), gate)
    if hot:
        assert torch.equal(split[2].cpu(), g_hot_ref)
    _assert_long_rows(pat)


def _assert_long_rows(pat):
    """The compaction's list of long rows (served first by the row kernels) holds exactly the rows with
    more than its limit of entries by the pattern's row_ptr, each with its slot."""
    lengths = pat.row_ptr[1:].cpu() - pat.row_ptr[:-1].cpu()
    n = int(pat.long.count[0])
    listed = pat.long.rows[:n].cpu().tolist()
    assert sorted(listed) == (lengths > pat.long.limit).nonzero().flatten().tolist()
    assert [int(pat.long.slots[r]) for r in listed] == list(range(n))


def test_pack_positive_bits_sets_bit_31():
    from twell.kernels.bitmask import pack_positive_bits

    h = torch.zeros(2, 64)
    h[0, 31] = h[0, 32] = h[1, 0] = 1.0
    h[1, 63] = 2.0
    assert pack_positive_bits(h).tolist() == [[-(2**31), 1], [1, -(2**31)]]


def test_to_csc_groups_entries_by_column_stably():
    from twell.kernels.training.train_format import to_csc

    n, F = 300, 40
    rows = torch.arange(n, dtype=torch.int32) // 3
    cols = torch.randint(0, F - 5, (n,), dtype=torch.int32)  # the last columns stay empty
    coefs = tuple(torch.randn(n) for _ in range(3))
    col_ptr, rows_c, coefs_c = to_csc(
        *(t.to(DEVICE) for t in (rows, cols)), tuple(c.to(DEVICE) for c in coefs), F
    )
    order = torch.argsort(cols, stable=True)
    assert col_ptr.dtype == torch.int32
    assert col_ptr.cpu().tolist() == [0] + torch.bincount(cols, minlength=F).cumsum(0).tolist()
    assert torch.equal(rows_c.cpu(), rows[order])
    for got, c in zip(coefs_c, coefs):
        assert torch.equal(got.cpu(), c[order])


@pytest.mark.parametrize("l1", [0.0, 3e-4])
def test_entry_grads_match_the_chain_rule(l1):
    """One kernel for dh = dy . w_down + l1 * sign(g u), d_gate = dh u, d_up = dh g, h = g u; entries
    with u = 0 (sign 0) and negative u included."""
    dy, wd = torch.randn(9, 128, dtype=torch.bfloat16), torch.randn(17, 128, dtype=torch.bfloat16)
    rows, cols = torch.randint(0, 9, (41,), dtype=torch.int32), torch.randint(0, 17, (41,), dtype=torch.int32)
    gate = torch.rand(41).add(0.1).to(torch.bfloat16)
    up = torch.randn(41)
    up[:5] = 0.0
    grad_l1, M = torch.tensor(l1), 9  # d loss / d l1, with l1 = sum |h| / M
    got = entry_grads(*(t.to(DEVICE) for t in (rows, cols, dy, wd, gate, up, grad_l1)), M)
    h = gate.double() * up.double()
    dh = (dy.double()[rows.long()] * wd.double()[cols.long()]).sum(1) + l1 / M * torch.sign(h)
    for g, e in zip(got, (dh * up.double(), dh * gate.double(), h)):
        torch.testing.assert_close(g.cpu().double(), e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: [t[0][:, :48].contiguous(), *t[1:]], "d_model=48 must be a multiple of 64"),
        (lambda t: [t[0], t[1][:100].contiguous(), *t[2:]], "d_ff=100 must be a multiple of 64"),
        (lambda t: [t[0].to(torch.float64), *t[1:]], "is not supported"),
        (lambda t: [t[0], t[1], t[2].to(torch.bfloat16), t[3]], "differs from x.dtype"),
        (lambda t: [t[0], t[1], t[2], t[3][:64].contiguous()], "w_down has shape"),
        (lambda t: [t[0][None], *t[1:]], "must be 2-D"),
        (lambda t: [t[0].t().contiguous().t(), *t[1:]], "must be contiguous"),
    ],
)
def test_bad_inputs_raise_a_clear_error(change, message):
    inputs = _inputs(64, 64, 128, torch.float32)
    with pytest.raises(ValueError, match=message):
        twell_ffn(*change(inputs))


@pytest.mark.parametrize("hot", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hot_units_match_reference_with_dense_and_silent_rows(hot, dtype):
    """Hot units (every product on dense GEMMs for the K most frequent units, the sparse kernels for
    the rest): y, l1 and all four gradients, with dense rows (long CSR rows of cold units) and hot = F
    (no sparse entry at all); unit_fires / row_active still count every positive."""
    M, D, F = 45, 64, 256
    x, w_gate, w_up, w_down = _inputs(M, D, F, dtype, mean_active=10.0)
    make_rows_dense(x, [3, 30])
    make_rows_silent(x, [7])
    make_rows_heavy_tailed(x, list(range(10, 20)), seed=_fresh_seed())
    try:
        set_hot_units(hot)
        out = _check_against_reference([x, w_gate, w_up, w_down])
    finally:
        set_hot_units(None)
    assert int(out.overflow_rows) == 0
    if dtype == torch.float32:
        assert out.row_active[[3, 30]].gt(F // 4).all() and int(out.row_active[7]) == 0


def test_hot_units_are_deterministic_and_off_by_default_on_cpu():
    inputs = _inputs(33, 64, 192, torch.float32)
    make_rows_dense(inputs[0], [2])
    grad_y = torch.randn(33, 64, device=DEVICE)
    assert hot_units_for(33, 192) == 0 and hot_units_for(1 << 20, 5632) in (0, 1024)
    try:
        set_hot_units(32)
        first, second = _run(twell_ffn, inputs, grad_y, 0.4), _run(twell_ffn, inputs, grad_y, 0.4)
    finally:
        set_hot_units(None)
    assert torch.equal(first[0].y, second[0].y)
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="hot units k=-1 must be >= 0"):
        set_hot_units(-1)
    # The per-call argument (what ModelConfig.twell_hot_units reaches) equals the module setting.
    third = _run(lambda *t: twell_ffn(*t, hot_units=32), inputs, grad_y, 0.4)
    assert torch.equal(third[0].y, first[0].y)
    for a, b in zip(third[1], first[1]):
        assert torch.equal(a, b)
    assert hot_units_for(33, 192, 0) == 0 and hot_units_for(33, 192, 500) == 192
    with pytest.raises(ValueError, match=r"hot_units=-2 must be an integer >= 0"):
        twell_ffn(*inputs, hot_units=-2)


def test_entry_list_sized_from_the_last_call_matches_exact_sizes_and_redoes_a_miss(monkeypatch):
    """The default sizing: a layer's first call is exact (one sync), later calls take the previous
    count plus a margin and check it only after issuing the forward. A fit gives bit-identical results
    to exact sizes; too few slots (or a batch with many more positives) redo the call exactly (right
    answer) and reset the estimate. (The eager path: the per-layer CUDA graphs, opt-in, are tested in
    test_train_graph.py; turned off here whatever TWELL_OP_GRAPHS says.)"""
    import twell.kernels.training.train as kt
    from twell.kernels.training import train_graph

    monkeypatch.setitem(train_graph._settings, "on", False)

    M, D, F = 37, 64, 256
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32, mean_active=8.0)
    weights = [t.clone().requires_grad_() for t in (w_gate, w_up, w_down)]  # one "layer": fixed tensors
    grad_y = torch.randn(M, D, device=DEVICE)
    seen = []  # the capacity of each _forward pass and whether it returned (None: a miss)
    real = kt._forward
    monkeypatch.setattr(
        kt, "_forward", lambda *a, **k: seen.append((a[5], (out := real(*a, **k)) is not None)) or out
    )

    def step(x_in):
        out, grads = _grad_step(weights, x_in, grad_y, hot=None)
        ref, ref_grads = _run(relu_ffn, [x_in, *weights], grad_y.double(), 0.3, dtype=torch.float64)
        for a, b in zip([out.y, out.l1, *grads], [ref.y, ref.l1, *ref_grads]):
            assert _rel_err(a, b) <= 1e-5
        return out, grads

    first, first_grads = step(x)
    nnz = int(first.row_active.sum())
    assert seen == [(None, True)] and int(first.overflow_rows) == 0
    assert kt._capacities[weights[0]][(M, 0)] == kt._with_margin(nnz)
    second, second_grads = step(x)  # from the estimate, no sync until the forward is issued
    assert seen[1] == (kt._with_margin(nnz), True)
    assert torch.equal(second.y, first.y) and torch.equal(second.l1, first.l1)
    assert all(torch.equal(a, b) for a, b in zip(second_grads, first_grads))

    kt._capacities[weights[0]][(M, 0)] = 8  # far fewer slots than entries: rows past them are cut
    seen.clear()
    redone = kt.entry_misses()["redone"]
    step(x)
    assert seen == [(8, False), (None, True)]  # the miss is redone exactly
    assert kt.entry_misses()["redone"] == redone + 1
    assert kt._capacities[weights[0]][(M, 0)] == kt._with_margin(nnz)

    dense_x = x.clone()
    make_rows_dense(dense_x, list(range(0, M, 2)))  # ~19 F entries: far past the estimate's margin
    seen.clear()
    out, _ = step(dense_x)
    assert seen == [(kt._with_margin(nnz), False), (None, True)]
    seen.clear()
    again, _ = step(dense_x)  # the new estimate fits: no redo
    assert seen == [(kt._with_margin(int(out.row_active.sum())), True)]
    assert torch.equal(again.unit_fires, out.unit_fires) and torch.equal(again.row_active, out.row_active)
    try:
        kt.set_sizes("exact")
        seen.clear()
        step(x)
        step(x)
        assert seen == [(None, True), (None, True)]
    finally:
        kt.set_sizes("estimate")
    with pytest.raises(ValueError, match="sizes 'sometimes' is unknown"):
        kt.set_sizes("sometimes")


def test_capacity_headroom_widens_the_sized_capacity_inside_the_block_only():
    """A graph's owner captures with a wider headroom after misses; the eager default is 1/8 + 2048
    slots in 1024 steps, and a headroom outside [0, MAX_HEADROOM] is refused with the range."""
    import twell.kernels.training.train as kt

    assert kt._with_margin(80_000) == (80_000 + 10_000 + 2048) // 1024 * 1024
    with kt.capacity_headroom(1.0):
        assert kt._with_margin(80_000) == (160_000 + 2048) // 1024 * 1024
        with kt.capacity_headroom(0):
            assert kt._with_margin(80_000) == 82_048 // 1024 * 1024
        assert kt.oversized(2 * 166_000, 80_000) and not kt.oversized(2 * 161_000, 80_000)
    assert kt._settings["headroom"] == kt.DEFAULT_HEADROOM
    for bad in (-0.5, kt.MAX_HEADROOM + 1):
        with pytest.raises(ValueError, match=r"headroom .* out of range"), kt.capacity_headroom(bad):
            pass
    assert kt._settings["headroom"] == kt.DEFAULT_HEADROOM


def _grad_step(weights, x_in, grad_y, hot=0, fn=twell_ffn):
    """One forward and backward of fn on a fresh leaf of x_in: (output, [dx, dw_gate, dw_up, dw_down])."""
    leaf = x_in.clone().requires_grad_()
    for w in weights:
        w.grad = None
    out = fn(leaf, *weights, hot_units=hot)
    ((out.y * grad_y).sum() + 0.3 * out.l1).backward()
    return out, [leaf.grad] + [w.grad.clone() for w in weights]


@pytest.mark.parametrize("hot,variant", [(0, "fused3"), (16, "fused3"), (0, "split")])
def test_static_sizes_give_exact_results_and_count_misses_on_the_device(hot, variant):
    """ "static" (what a CUDA graph capture uses): the previous call's count plus a margin as a fixed
    size, nothing read back. The unused slots must contribute nothing to y, l1 and the four gradients;
    a call whose entries do not fit is counted in static_misses; dense rows that fit are exact."""
    import twell.kernels.training.train as kt

    M, D, F = 41, 64, 256
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32, mean_active=8.0)
    weights = [t.clone().requires_grad_() for t in (w_gate, w_up, w_down)]
    grad_y = torch.randn(M, D, device=DEVICE)
    misses = kt.static_misses(DEVICE)
    misses.zero_()

    def step(x_in):
        return _grad_step(weights, x_in, grad_y, hot)

    try:
        kt.set_sizes("static")
        set_backward_variant(variant)  # the unused slots meet every backward schedule
        first, _ = step(x)  # no history yet: an exact call, which records the count
        capacity = kt._capacities[weights[0]][(M, hot)]
        out, grads = step(x)
        assert int(misses) == 0 and kt._capacities[weights[0]][(M, hot)] == capacity  # static: not updated
        ref, ref_grads = _run(relu_ffn, [x, *weights], grad_y.double(), 0.3, dtype=torch.float64)
        for a, b in zip([out.y, out.l1, *grads], [ref.y, ref.l1, *ref_grads]):
            assert _rel_err(a, b) <= 1e-5
        assert torch.equal(out.row_active, first.row_active) and torch.equal(out.unit_fires, first.unit_fires)

        kt._capacities[weights[0]][(M, hot)] = 8  # too small: counted, not redone
        step(x)
        assert int(misses) == 1
        kt._capacities[weights[0]][(M, hot)] = capacity
        dense_x = x.clone()
        make_rows_dense(dense_x, list(range(0, M, 2)))  # ~21 F entries: past the captured capacity
        step(dense_x)
        assert int(misses) == 2
        kt._capacities[weights[0]][(M, hot)] = capacity + M * F  # room for them: exact, not a miss
        out, grads = step(dense_x)
        assert int(misses) == 2 and int(out.overflow_rows) == 0
        ref, ref_grads = _run(relu_ffn, [dense_x, *weights], grad_y.double(), 0.3, dtype=torch.float64)
        for a, b in zip([out.y, out.l1, *grads], [ref.y, ref.l1, *ref_grads]):
            assert _rel_err(a, b) <= 1e-5
    finally:
        kt.set_sizes("estimate")
        set_backward_variant("auto")
        misses.zero_()


@pytest.mark.parametrize("hot,variant", [(0, "fused3"), (16, "fused3"), (0, "split")])
def test_late_sizes_never_wait_in_the_forward_and_stay_exact_on_a_miss(hot, variant, monkeypatch):
    """ "late": after a layer's first (exact) call, the forward takes the last count plus a margin and
    reads nothing back; the positives past the slots count in y and l1 from the dense h, so the outputs
    are exact whatever the count, and the backward cuts the list to the count or, on a miss, rebuilds the
    entries exactly. The layer's next call is sized from the count (read then, long computed)."""
    import twell.kernels.training.train as kt
    from twell.kernels.training import train_graph

    monkeypatch.setitem(train_graph._settings, "on", False)
    M, D, F = 43, 64, 256
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32, mean_active=8.0)
    weights = [t.clone().requires_grad_() for t in (w_gate, w_up, w_down)]
    grad_y = torch.randn(M, D, device=DEVICE)
    calls = []  # each _forward pass: (capacity, late)
    real = kt._forward
    monkeypatch.setattr(
        kt, "_forward", lambda *a, **k: calls.append((a[5], k.get("late", False))) or real(*a, **k)
    )
    reads = []  # the estimate's read-backs in the forward (PendingTotals): none may happen
    real_read = train_format.PendingTotals.read
    monkeypatch.setattr(train_format.PendingTotals, "read", lambda self: reads.append(1) or real_read(self))

    def step(x_in):
        out, grads = _grad_step(weights, x_in, grad_y, hot)
        ref, ref_grads = _run(relu_ffn, [x_in, *weights], grad_y.double(), 0.3, dtype=torch.float64)
        for a, b in zip([out.y, out.l1, *grads], [ref.y, ref.l1, *ref_grads]):
            assert _rel_err(a, b) <= 1e-5
        return out, grads

    try:
        kt.set_sizes("late")
        set_backward_variant(variant)
        first, first_grads = step(x)  # no history: exact
        nnz = int(first.row_active.sum()) - (int(first.unit_fires.topk(hot).values.sum()) if hot else 0)
        assert calls == [(None, False)]
        calls.clear()
        second, second_grads = step(x)  # sized from the first call's count, read nothing back
        capacity = kt._deferred_capacity(nnz)  # late calls size by a high-water mark (a miss costs more)
        assert calls == [(capacity, True)] and not reads
        assert torch.equal(second.row_active, first.row_active) and torch.equal(
            second.unit_fires, first.unit_fires
        )
        assert torch.allclose(second.y, first.y, rtol=1e-6, atol=1e-6)
        for a, b in zip(second_grads, first_grads):
            assert torch.equal(a, b)  # the backward cut the list to the count: the exact call's entries

        kt._late_last[weights[0]].pop((M, hot))  # (unread, it would size the next call)
        kt._capacities[weights[0]][(M, hot)] = 8  # far too few slots: y from h, the backward rebuilds
        calls.clear()
        rebuilt = kt.entry_misses()["rebuilt"]
        step(x)
        assert calls == [(8, True), (None, False)]  # the forward once, late; the rebuild in the backward
        assert kt.entry_misses()["rebuilt"] == rebuilt + 1
        calls.clear()
        step(x)  # the missed call's count sized this one
        assert calls == [(capacity, True)]
        dense_x = x.clone()
        make_rows_dense(dense_x, list(range(0, M, 2)))  # ~21 F entries: far past the margin
        calls.clear()
        out, _ = step(dense_x)
        assert calls == [(capacity, True), (None, False)] and int(out.overflow_rows) == 0
        assert kt.entry_misses()["rebuilt"] == rebuilt + 2
        dense_nnz = int(out.row_active.sum()) - (int(out.unit_fires.topk(hot).values.sum()) if hot else 0)
        calls.clear()
        step(x)  # sparse again: the burst's capacity holds (a high-water mark) ...
        step(x)  # ... and shrinks by DEFERRED_DECAY a call
        burst = kt._deferred_capacity(dense_nnz)
        assert calls == [(burst, True), (int(burst * kt.DEFERRED_DECAY) // 1024 * 1024, True)]
        assert not reads  # no forward ever waited for its count
    finally:
        kt.set_sizes("estimate")
        set_backward_variant("auto")


def test_late_sizes_keep_the_capacity_for_a_checkpointed_recomputation():
    """A checkpointed block's recomputed call runs inside the backward: it must take the capacity of the
    call it recomputes (torch.utils.checkpoint compares the saved tensors' shapes), not the one that
    call's count would give, and its gradients are those of the plain call."""
    import twell.kernels.training.train as kt

    inputs = _inputs(29, 64, 192, torch.float32, mean_active=8.0)
    grad_y = torch.randn(29, 64, device=DEVICE)

    def ffn_loss(*ts):
        out = twell_ffn(*ts)
        return (out.y * grad_y).sum() + 0.3 * out.l1

    try:
        kt.set_sizes("late")
        weights = [t.clone().requires_grad_() for t in inputs[1:]]
        ffn_loss(inputs[0], *weights).backward()  # exact first call: the history

        def too_few_slots():  # a miss now: its count would size the next call wider
            kt._late_last.get(weights[0], {}).pop((29, 0), None)
            kt._capacities[weights[0]][(29, 0)] = 8

        too_few_slots()
        plain = [inputs[0].clone().requires_grad_(), *weights]
        for w in weights:
            w.grad = None
        ffn_loss(*plain).backward()
        plain_grads = [t.grad.clone() for t in plain]
        too_few_slots()
        for w in weights:
            w.grad = None
        ckpt = [inputs[0].clone().requires_grad_(), *weights]
        torch.utils.checkpoint.checkpoint(ffn_loss, *ckpt, use_reentrant=False).backward()
        for a, b in zip(plain_grads, ckpt):
            assert torch.equal(a, b.grad)
    finally:
        kt.set_sizes("estimate")


def test_late_sizes_check_each_call_by_its_own_count_when_calls_of_a_layer_precede_their_backwards():
    """Two late calls of one layer before one backward: the first misses (dense rows), the second fits.
    Each backward takes its own call's count (the first's rebuilt, the second's cut), never the layer's
    last one: the gradients are those of the fp64 reference."""
    import twell.kernels.training.train as kt

    M, D, F = 31, 64, 256
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32, mean_active=8.0)
    dense_x = x.clone()
    make_rows_dense(dense_x, list(range(0, M, 2)))
    weights = [t.clone().requires_grad_() for t in (w_gate, w_up, w_down)]
    grads_y = torch.randn(2, M, D, device=DEVICE)
    try:
        kt.set_sizes("late")
        twell_ffn(x, *weights)  # the exact first call: the history
        leaves = [t.clone().requires_grad_() for t in (dense_x, x)]
        outs = [twell_ffn(leaf, *weights) for leaf in leaves]  # the first misses, the second fits
        sum(((o.y * g).sum() + 0.3 * o.l1) for o, g in zip(outs, grads_y)).backward()
    finally:
        kt.set_sizes("estimate")
    ref_w = [w.detach().double().requires_grad_() for w in weights]
    ref_leaves = [t.double().requires_grad_() for t in (dense_x, x)]
    refs = [relu_ffn(leaf, *ref_w) for leaf in ref_leaves]
    sum(((r.y * g.double()).sum() + 0.3 * r.l1) for r, g in zip(refs, grads_y)).backward()
    for a, b in zip([*leaves, *weights], [*ref_leaves, *ref_w]):
        assert _rel_err(a.grad, b.grad) <= 1e-5


def test_late_backward_finds_its_calls_count_without_reading_the_device(monkeypatch):
    """Each backward under sizes "late" takes its call's count from the host copy made behind the forward
    (found by the saved row_ptr's storage), eager, compiled, checkpointed and selectively checkpointed
    (whose cache hands the backward other tensors) alike: reading row_ptr[M] there would wait for
    everything the host has issued since (a whole-queue sync a layer on a GPU)."""
    import twell.kernels.training.train as kt

    found = []
    real = kt._count_of
    monkeypatch.setattr(kt, "_count_of", lambda row_ptr: found.append((c := real(row_ptr)) is not None) or c)
    M, D, F = 24, 64, 128
    x, *weights = _inputs(M, D, F, torch.float32, mean_active=6.0)
    weights = [t.requires_grad_() for t in weights]
    ways = {
        "eager": twell_ffn,
        "compiled": torch.compile(twell_ffn, backend="aot_eager", fullgraph=True),
        "checkpointed": lambda *a: torch.utils.checkpoint.checkpoint(twell_ffn, *a, use_reentrant=False),
        "selectively checkpointed": lambda *a: torch.utils.checkpoint.checkpoint(
            twell_ffn, *a, use_reentrant=False, context_fn=kt.checkpoint_context
        ),
    }
    try:
        kt.set_sizes("late")
        for name, fn in ways.items():
            found.clear()
            for _ in range(2):  # the layer's first call (exact) and a late one
                out = fn(x.clone().requires_grad_(), *weights)
                (out.y.sum() + out.l1).backward()
            assert found == [True, True], name
    finally:
        kt.set_sizes("estimate")


def test_late_counts_of_forwards_without_a_backward_are_dropped(monkeypatch):
    """Forwards without a backward (evaluation) leave their counts behind; once their storages are freed,
    the entries go at the next sweep: the table stays bounded over a long run."""
    import twell.kernels.training.train as kt

    monkeypatch.setattr(kt, "_LATE_SWEEP", 4)
    monkeypatch.setattr(kt, "_late_by_list", {})
    inputs = _inputs(16, 64, 128, torch.float32, mean_active=6.0)
    try:
        kt.set_sizes("late")
        with torch.no_grad():
            for _ in range(12):
                twell_ffn(*inputs)
                assert len(kt._late_by_list) <= 4
    finally:
        kt.set_sizes("estimate")


def test_capture_without_a_prior_eager_call_asks_for_one(monkeypatch):
    import twell.kernels.training.train as kt

    monkeypatch.setattr(kt, "_capturing", lambda x: True)
    inputs = _inputs(9, 64, 128, torch.float32)
    with pytest.raises(RuntimeError, match="run the same step once eagerly before capturing"):
        twell_ffn(*inputs)


@pytest.mark.parametrize("hot", [0, 16])
def test_static_calls_record_their_capacity_and_true_entry_count(hot):
    """record_static_sizes: what a CUDA graph's owner reads to find capacities far above the layers'
    current counts (oversized). The recorded count is the call's cold entries, as an eager call's."""
    import twell.kernels.training.train as kt

    M, D, F = 33, 64, 256
    x, *weights = _inputs(M, D, F, torch.float32, mean_active=8.0)
    eager = twell_ffn(x, *weights, hot_units=hot)  # exact: records the layer's count
    nnz = int(eager.row_active.sum()) if not hot else None
    capacity = kt._capacities[weights[0]][(M, hot)]
    try:
        kt.set_sizes("static")
        with kt.record_static_sizes() as sizes:
            twell_ffn(x, *weights, hot_units=hot)
        twell_ffn(x, *weights, hot_units=hot)  # outside the block: not recorded
    finally:
        kt.set_sizes("estimate")
    assert len(sizes) == 1 and sizes[0][0] == capacity
    entries = int(sizes[0][1])
    assert capacity == kt._with_margin(entries)
    if nnz is not None:
        assert entries == nnz  # no hot units: every positive is an entry
    assert not kt.oversized(capacity, entries)
    assert kt.oversized(2 * capacity + 1, entries) and not kt.oversized(2 * capacity, entries)


@pytest.mark.parametrize("hot", [0, 16])
def test_deferred_sizes_read_nothing_back_until_settled_and_report_a_miss(hot, monkeypatch):
    """deferred_sizes(): after a layer's first (exact) call, every call takes the fixed capacity from
    its history and reads nothing back; settle() reads all counts at once, sizes the next calls from
    the largest, and says whether any call missed. A fit is exact; a miss is reported, and the same
    batch then fits (redone inside or outside the block, the results are exact)."""
    import twell.kernels.training.train as kt
    from twell.kernels.training.train_format import PendingTotals

    M, D, F = 41, 64, 256
    x, w_gate, w_up, w_down = _inputs(M, D, F, torch.float32, mean_active=8.0)
    weights = [t.clone().requires_grad_() for t in (w_gate, w_up, w_down)]
    grad_y = torch.randn(M, D, device=DEVICE)
    ref, ref_grads = _run(relu_ffn, [x, *weights], grad_y.double(), 0.3, dtype=torch.float64)
    reads = []
    real_read = PendingTotals.read
    monkeypatch.setattr(PendingTotals, "read", lambda self: reads.append(1) or real_read(self))

    def check(out, grads, want=ref, want_grads=ref_grads):
        for a, b in zip([out.y, out.l1, *grads], [want.y, want.l1, *want_grads]):
            assert _rel_err(a, b) <= 1e-5

    with kt.deferred_sizes() as sizes:
        check(*_grad_step(weights, x, grad_y, hot))  # no history: exact (records one)
        capacity = kt._capacities[weights[0]][(M, hot)]
        out, grads = _grad_step(weights, x, grad_y, hot)
        out2, _ = _grad_step(weights, x, grad_y, hot)
        assert not reads and len(sizes.calls) == 2  # the exact call is not deferred
        entries = int(sizes.calls[0][3])
        assert not sizes.settle() and not sizes.calls
        check(out, grads)
        assert torch.equal(out2.y, out.y)
        assert kt._capacities[weights[0]][(M, hot)] == kt._deferred_capacity(entries) == capacity

        dense_x = x.clone()
        make_rows_dense(dense_x, list(range(0, M, 2)))  # far more entries than the capacity holds
        _grad_step(weights, dense_x, grad_y, hot)
        assert sizes.settle()  # missed: those results are wrong, and the capacity now fits the batch
        assert kt._capacities[weights[0]][(M, hot)] > capacity
        out, grads = _grad_step(weights, dense_x, grad_y, hot)
        assert not sizes.settle()
    dense_ref, dense_grads = _run(relu_ffn, [dense_x, *weights], grad_y.double(), 0.3, dtype=torch.float64)
    check(out, grads, dense_ref, dense_grads)
    assert not reads
    assert kt._settings["sizes"] == "estimate" and kt._deferred is None  # restored


def test_deferred_miss_left_unsettled_raises_and_settle_reduces_a_flag():
    import twell.kernels.training.train as kt

    M, D, F = 33, 64, 128
    x, *weights = _inputs(M, D, F, torch.float32, mean_active=6.0)
    grad_y = torch.randn(M, D, device=DEVICE)
    weights = [t.requires_grad_() for t in weights]
    _grad_step(weights, x, grad_y)  # history
    kt._capacities[weights[0]][(M, 0)] = 8  # far too small
    with pytest.raises(RuntimeError, match="ended without settle"), kt.deferred_sizes():
        _grad_step(weights, x, grad_y)
    flags = []
    with kt.deferred_sizes() as sizes:
        _grad_step(weights, x, grad_y)  # fits now: the block's exit settled the miss above
        # this call fitted (flag 0), but the reduced flag decides (another rank missed): every rank redoes
        assert sizes.settle(reduce=lambda flag: flags.append(int(flag)) or flag.fill_(1))
        assert not sizes.settle()  # nothing left to settle
    assert flags == [0]
    with kt.deferred_sizes() as sizes:
        assert sizes.settle(reduce=lambda flag: flag.fill_(1), device=DEVICE)  # no calls: the flag alone
        with pytest.raises(ValueError, match="needs the device"):
            sizes.settle(reduce=lambda flag: flag)


def _compiled_op_recording_forwards(kt, flag: str):
    """The compiled-op sizing tests' set-up: twell_ffn compiled (aot_eager, fullgraph) with a compile
    counter, and kt._forward wrapped to record (capacity, its `flag` keyword) of each pass (the caller
    restores `real`). Returns M, x, a denser x (every unit on every row), the weights, grad_y, the compiled
    op, the counter, the records and the real _forward."""
    import torch._dynamo.testing

    M, D, F = 24, 64, 128
    x, *weights = _inputs(M, D, F, torch.float32, mean_active=6.0)
    weights = [t.requires_grad_() for t in weights]
    grad_y = torch.randn(M, D, device=DEVICE)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twell_ffn, backend=counter, fullgraph=True, dynamic=False)
    seen = []
    real = kt._forward
    kt._forward = lambda *a, **k: seen.append((a[5], k.get(flag, False))) or real(*a, **k)
    denser = x.clone()
    make_rows_dense(denser, list(range(M)))
    return M, x, denser, weights, grad_y, compiled, counter, seen, real


def test_compiled_op_takes_deferred_sizes_from_the_layer_history_without_recompiling():
    """A torch.compile'd step (fullgraph) sizes its entry lists when it runs: the layer's history
    reaches the op (its w_gate is the key), calls inside deferred_sizes() are fixed-size and exact, and
    sparsity changing between steps recompiles nothing."""
    import twell.kernels.training.train as kt

    M, x, denser, weights, grad_y, compiled, counter, seen, real = _compiled_op_recording_forwards(
        kt, "static"
    )
    try:
        with kt.deferred_sizes() as sizes:
            outcomes = []
            for x_in in (x, x, denser, denser):
                out, grads = _grad_step(weights, x_in, grad_y, fn=compiled)
                outcomes.append((sizes.settle(), kt._capacities[weights[0]][(M, 0)]))
                ref, ref_grads = _run(relu_ffn, [x_in, *weights], grad_y.double(), 0.3, dtype=torch.float64)
                if not outcomes[-1][0]:
                    for a, b in zip([out.y, out.l1, *grads], [ref.y, ref.l1, *ref_grads]):
                        assert _rel_err(a, b) <= 1e-5
    finally:
        kt._forward = real
    first_capacity = outcomes[0][1]
    assert seen[0] == (None, False)  # the first call: exact, which records the history
    assert seen[1:] == [(first_capacity, True), (first_capacity, True), (outcomes[2][1], True)]
    assert [missed for missed, _ in outcomes] == [False, False, True, False]  # the denser batch: once
    assert counter.frame_count == 1  # one graph for every step


def test_compiled_op_takes_late_sizes_exactly_without_recompiling():
    """A torch.compile'd step (fullgraph) under sizes "late": after the exact first call every forward is
    late, a batch past the capacity still gives exact outputs and gradients (its backward rebuilds the
    entries), and the step is compiled once."""
    import twell.kernels.training.train as kt

    M, x, denser, weights, grad_y, compiled, counter, seen, real = _compiled_op_recording_forwards(kt, "late")
    F = weights[0].shape[0]
    try:
        kt.set_sizes("late")
        for x_in in (x, x, denser, x):
            out, grads = _grad_step(weights, x_in, grad_y, fn=compiled)
            ref, ref_grads = _run(relu_ffn, [x_in, *weights], grad_y.double(), 0.3, dtype=torch.float64)
            for a, b in zip([out.y, out.l1, *grads], [ref.y, ref.l1, *ref_grads]):
                assert _rel_err(a, b) <= 1e-5
    finally:
        kt._forward = real
        kt.set_sizes("estimate")
    capacity = kt._deferred_capacity(int(out.row_active.sum()))  # late calls: a high-water mark
    assert seen == [
        (None, False),
        (capacity, True),
        (capacity, True),
        (None, False),
        (kt._deferred_capacity(M * F), True),
    ]
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("hot", [0, 256])
def test_training_step_replays_in_a_cuda_graph(hot):
    """Forward + backward captured in one CUDA graph (static sizes, no host sync) after eager calls:
    replays give the eager step's outputs and gradients, and count no miss."""
    import twell.kernels.training.train as kt

    M, D, F = 4096, 512, 2048
    inputs = _inputs(M, D, F, torch.bfloat16, mean_active=12.0)
    leaves = [t.clone().requires_grad_() for t in inputs]
    grad_y = torch.randn(M, D, device=DEVICE, dtype=torch.bfloat16)
    l1_grad = torch.tensor(0.5, device=DEVICE)

    def step():
        for t in leaves:
            t.grad = None
        out = twell_ffn(*leaves, hot_units=hot)
        torch.autograd.backward([out.y, out.l1], [grad_y, l1_grad])
        return out

    eager = step()
    eager_y, eager_grads = eager.y.clone(), [t.grad.clone() for t in leaves]
    misses = kt.static_misses(DEVICE)
    misses.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        kt.set_sizes("static")  # warm-up at the captured sizes (autotuning happens outside the capture)
        with torch.cuda.stream(side):
            # leaves whose gradient accumulators are made off the legacy stream (PyTorch's recipe)
            leaves = [t.detach().clone().requires_grad_() for t in leaves]
            step()  # a new layer (w_gate): an exact call that records its count
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for t in leaves:
            t.grad = None
        with torch.cuda.graph(graph):
            out = step()
    finally:
        kt.set_sizes("estimate")
    misses.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert int(misses) == 0
    assert _rel_err(out.y, eager_y) < 1e-2
    for a, b in zip([t.grad for t in leaves], eager_grads):
        assert _rel_err(a, b) < 1e-2


@pytest.mark.gpu
def test_hot_units_on_a_side_stream_give_the_one_stream_results_bit_for_bit():
    """The hot units' GEMMs run on a second stream beside the sparse kernels (forced on here; by default
    only inside a CUDA graph capture); every output and gradient equals the one-stream step's exactly,
    on repeated calls too."""
    M, D, F = 8192, 1024, 4096
    inputs = _inputs(M, D, F, torch.bfloat16, mean_active=29.0)
    make_rows_dense(inputs[0], [1, 4000])
    grad_y = torch.randn(M, D, device=DEVICE, dtype=torch.bfloat16)
    runs = []
    try:
        for on in (False, True, True, "auto"):
            set_streams(on)
            runs.append(_run(lambda *t: twell_ffn(*t, hot_units=512), inputs, grad_y, 0.4))
    finally:
        set_streams("auto")
    (ref, ref_grads), others = runs[0], runs[1:]
    for out, grads in others:
        assert torch.equal(out.y, ref.y) and torch.equal(out.l1, ref.l1)
        for a, b in zip(grads, ref_grads):
            assert torch.equal(a, b)


def test_streams_setting_is_checked():
    with pytest.raises(ValueError, match="streams 'yes' is unknown"):
        set_streams("yes")


def test_build_pattern_with_too_small_a_capacity_stays_in_bounds_and_reports_the_count():
    from twell.kernels.training.train_format import build_pattern

    M, F = 50, 192
    h, bits = _random_gate(M, F, torch.Generator().manual_seed(_fresh_seed()), density=0.2)
    args = [t.to(DEVICE) for t in (h, bits)]
    exact = build_pattern(*args)
    nnz = exact.rows.numel()
    cap = nnz // 2
    part = build_pattern(*args, capacity=cap)
    assert part.pending.read() == nnz and part.rows.numel() == cap
    assert torch.equal(part.row_ptr.cpu(), exact.row_ptr.cpu().clamp(max=cap))
    _assert_long_rows(exact)
    _assert_long_rows(part)  # by the clamped row_ptr, as the row kernels read it
    fits = int((exact.row_ptr[1:] <= cap).sum())  # rows wholly below the capacity are exact
    end = int(exact.row_ptr[fits])
    for name in ("rows", "cols", "gate"):
        assert torch.equal(getattr(part, name)[:end].cpu(), getattr(exact, name)[:end].cpu())
    roomy = build_pattern(*args, capacity=nnz + 100)
    assert roomy.pending.read() == nnz
    for name in ("rows", "cols", "gate"):
        assert torch.equal(getattr(roomy, name)[:nnz].cpu(), getattr(exact, name).cpu())
    static = build_pattern(*args, capacity=nnz + 100, static=True)
    assert static.pending is None and int(static.totals[1]) == nnz
    assert static.cols[nnz:].eq(F).all() and static.gate[nnz:].eq(0).all()  # unused slots: inert
    assert torch.equal(static.cols[:nnz].cpu(), exact.cols.cpu())


def test_unknown_backward_variant_is_rejected():
    with pytest.raises(ValueError, match="backward variant 'nope' is unknown"):
        set_backward_variant("nope")


@pytest.mark.gpu
@pytest.mark.parametrize("hot", [None, 0])
@pytest.mark.parametrize("F", [5632, 8192])
def test_paper_sizes_on_gpu(F, hot):
    """hot None: the default at 16384 tokens (DEFAULT_HOT_UNITS on dense GEMMs); 0: all sparse."""
    M, D = 16384, 2048
    inputs = _inputs(M, D, F, torch.bfloat16, mean_active=29.0)
    make_rows_dense(inputs[0], [0, 5000])
    set_hot_units(hot)
    try:
        out = _check_against_reference(inputs)
    finally:
        set_hot_units(None)
    assert int(out.overflow_rows) == 0 and out.row_active[[0, 5000]].gt(F // 4).all()
    # Saved state beyond the inputs: <= 25% of what a dense FFN saves (g, u, h: 3 x [M, F]).
    saved = []
    leaves = [t.clone().requires_grad_() for t in inputs]
    set_hot_units(hot)
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            twell_ffn(*leaves)
    finally:
        set_hot_units(None)
    ptrs = {t.data_ptr() for t in leaves}
    extra = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in ptrs)
    assert extra <= 0.25 * 3 * M * F * 2
