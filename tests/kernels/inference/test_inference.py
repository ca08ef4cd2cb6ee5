import pytest
import torch

from twell.kernels import twell_ffn_inference
from twell.kernels.inference import decode_fused
from twell.kernels.synthetic import (
    make_rows_dense,
    make_rows_heavy_tailed,
    make_rows_silent,
    make_units_always_active,
    paper_like_ffn_inputs,
)

# The interpreter rounds fp32 -> bf16 by truncation (2x the error of the GPU's round-to-nearest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW_TOL = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2}


def _row_errors(y, x, wg, wu, wd):
    """Per-row relative error against the float64 FFN on the same (rounded) inputs."""
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    ref = (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd
    return (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3), ref


def _hard_inputs(M, D, F, dtype, seed):
    """Paper-like activity plus every hard pattern: silent, fully dense and heavy-tailed rows, and one
    column tile where every unit fires on the silent rows."""
    x, wg, wu, wd = paper_like_ffn_inputs(M, D, F, mean_active=F / 40, dtype=dtype, seed=seed)
    rows = torch.randperm(M, generator=torch.Generator().manual_seed(seed))
    make_rows_heavy_tailed(x, rows[: max(1, M // 4)], seed=seed)
    make_rows_silent(x, rows[-max(1, M // 8) :])
    make_rows_dense(x, rows[:1])
    make_units_always_active(wg, slice(F - 64, F))
    return x, wg, wu, wd


@pytest.mark.parametrize("split,hot", [(1, 0), (3, 0), (1, 64)])
@pytest.mark.parametrize(
    "M,D,F,dtype",
    [(67, 128, 320, torch.bfloat16), (7, 64, 192, torch.float32), (1, 64, 128, torch.bfloat16)],
)
def test_inference_matches_reference_on_hard_patterns(split, hot, M, D, F, dtype, poisoned_empty):
    """hot > 0: the hot-unit split (K units dense on tensor cores, the rest in TwELL); the hot set comes
    from the batch itself, so the always-firing tile is usually hot and overflow is on cold units only."""
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(M, D, F, dtype, seed)
    y, stats = twell_ffn_inference(x, wg, wu, wd, slots=8, split=split, hot_units=hot, return_stats=True)
    assert y.dtype == dtype and y.shape == x.shape
    err, ref = _row_errors(y, x, wg, wu, wd)
    assert not torch.isnan(y).any()
    assert err.max() < ROW_TOL[dtype], (
        f"seed {seed}: worst row {int(err.argmax())} rel err {float(err.max()):.3g}"
    )
    if hot == 0:  # the dense row overflows its 8 slots in every tile and must be counted
        pre = x.double() @ wg.double().T
        tiles = pre.view(M, -1, 64) > 0
        assert int(stats.overflow_rows) == int((tiles.sum(-1) > 8).any(1).sum())
        assert int(stats.overflow_rows) >= 1


@pytest.mark.parametrize("hot", [64, 320])
def test_hot_units_with_forced_overflow_and_all_hot(hot, poisoned_empty):
    """Every hot column of a dense row is left to the dense part, its cold tiles still overflow (counted
    on cold positives only); hot = F puts every unit on tensor cores and leaves no TwELL entry at all."""
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(67, 64, 320, torch.bfloat16, seed)
    make_rows_dense(x, [5, 66])
    y, stats = twell_ffn_inference(x, wg, wu, wd, slots=4, hot_units=hot, return_stats=True)
    err, _ = _row_errors(y, x, wg, wu, wd)
    assert err.max() < ROW_TOL[torch.bfloat16], f"seed {seed}: rel err {float(err.max()):.3g}"
    if hot == 320:
        assert int(stats.overflow_rows) == 0
    else:
        assert int(stats.overflow_rows) >= 2  # 256 cold units fire on the dense rows: 4 slots overflow


def test_inference_all_zero_activity_gives_zero(poisoned_empty):
    x, wg, wu, wd = paper_like_ffn_inputs(5, 64, 128, mean_active=3.0, dtype=torch.float32, seed=0)
    make_rows_silent(x, slice(None))
    for hot in (0, 64):
        y = twell_ffn_inference(x, wg, wu, wd, hot_units=hot)
        assert torch.equal(y, torch.zeros_like(y))


def test_inference_rejects_bad_arguments():
    x, w = torch.randn(4, 64), torch.randn(128, 64)
    with pytest.raises(ValueError, match="w_down has shape"):
        twell_ffn_inference(x, w, w, torch.randn(64, 64))
    with pytest.raises(ValueError, match="schedule='fast' is not one of"):
        twell_ffn_inference(x, w, w, w, schedule="fast")
    with pytest.raises(ValueError, match="w_up is on"):
        twell_ffn_inference(x, w, w.to("meta"), w)


@pytest.mark.gpu
@pytest.mark.parametrize("hot", [0, 512, None])
@pytest.mark.parametrize("M", [1, 37, 16384])
def test_inference_at_paper_size(hot, M):
    x, wg, wu, wd = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=M)
    make_rows_dense(x, [M // 2])  # every unit fires: hot and cold tiles overflow on this row
    y, stats = twell_ffn_inference(x, wg, wu, wd, hot_units=hot, return_stats=True)
    ref = ((torch.relu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)) @ wd.float()).double()
    err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)
    assert err.max() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("M", [65, 16384])
def test_hot_prefix_at_paper_size(M):
    from twell.kernels import unit_order

    x, wg, wu, wd = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=M)
    make_rows_dense(x, [M // 2])
    order = unit_order((x.float() @ wg.float().T > 0).sum(0))
    wg, wu, wd = (w[order].contiguous() for w in (wg, wu, wd))
    y = twell_ffn_inference(x, wg, wu, wd, hot_prefix=512)
    ref = ((torch.relu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)) @ wd.float()).double()
    err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)
    assert err.max() < 1e-2, f"worst row {int(err.argmax())}: {float(err.max()):.3g}"


@pytest.mark.gpu
def test_hot_prefix_replays_in_a_cuda_graph():
    """No host sync on the prefix path: eager and graph-replayed calls agree bit for bit."""
    x, wg, wu, wd = paper_like_ffn_inputs(4099, 2048, 5632, device="cuda", seed=5)
    eager = twell_ffn_inference(x, wg, wu, wd, hot_prefix=256)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        twell_ffn_inference(x, wg, wu, wd, hot_prefix=256)
        with torch.cuda.graph(graph, stream=stream):
            out = twell_ffn_inference(x, wg, wu, wd, hot_prefix=256)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("path", ["fused", "two_kernel"])
def test_split_rows_are_summed_by_their_last_program(path, poisoned_empty):
    """split > 1: each program of a row stores a partial and the last one to take the row's ticket
    adds them up. The tickets start at zero whichever gate path runs (the fused gate kernel zeroes
    them; the two-kernel path fills them first): poisoned memory would leave rows unwritten."""
    from twell.kernels.gate import set_gate_variant

    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(67, 64, 192, torch.bfloat16, seed)
    set_gate_variant(path=path)
    try:
        y = twell_ffn_inference(x, wg, wu, wd, slots=8, split=4)
        again = twell_ffn_inference(x, wg, wu, wd, slots=8, split=4)
    finally:
        set_gate_variant()
    err, _ = _row_errors(y, x, wg, wu, wd)
    assert err.max() < ROW_TOL[torch.bfloat16], f"seed {seed}: rel err {float(err.max()):.3g}"
    assert torch.equal(y, again)  # partials summed in part order: run to run identical


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 64])
def test_decode_dense_row_takes_the_overflow_path(M):
    """The row schedule's decode format (64-wide tiles, 32 slots): a row where every unit fires
    overflows every tile and is recomputed exactly, counted in overflow_rows; the other rows stay on
    their slots."""
    x, wg, wu, wd = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=M)
    make_rows_dense(x, [M // 2])
    y, stats = twell_ffn_inference(x, wg, wu, wd, schedule="row", return_stats=True)
    ref = ((torch.relu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)) @ wd.float()).double()
    err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)
    assert err.max() < 1e-2, f"worst row {int(err.argmax())}: {float(err.max()):.3g}"
    assert int(stats.overflow_rows) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
def test_decode_replays_in_a_cuda_graph(M):
    """The row schedule at decode sizes in a CUDA graph (no host sync, no fill or cast nodes): every
    replay on new inputs is exact and identical to an eager call on them (the fused schedule's graph:
    test_fused_replays_in_a_cuda_graph)."""
    x, wg, wu, wd = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=M)
    static_x = x.clone()
    twell_ffn_inference(static_x, wg, wu, wd, schedule="row")  # autotune outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = twell_ffn_inference(static_x, wg, wu, wd, schedule="row")
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        fresh = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=1000 * seed + M)[0]
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        ref = (
            (torch.relu(fresh.float() @ wg.float().T) * (fresh.float() @ wu.float().T)) @ wd.float()
        ).double()
        err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)
        assert err.max() < 1e-2
        assert torch.equal(y, twell_ffn_inference(fresh, wg, wu, wd, schedule="row"))


@pytest.mark.parametrize("hot", [0, 64])
@pytest.mark.parametrize(
    "M,D,F,dtype",
    [(67, 128, 320, torch.bfloat16), (7, 64, 192, torch.float32), (130, 64, 128, torch.bfloat16)],
)
def test_csr_schedule_matches_reference_on_hard_patterns(hot, M, D, F, dtype, poisoned_empty):
    """schedule "csr": the bitmask CSR walked by the row kernel; dense, silent and heavy-tailed rows
    and an always-firing tile (a dense row is a long row). These small batches hold more positives
    than the CSR's capacity (32 slots a row at these d_ff): the rows past it are read from h."""
    import twell.kernels.inference.inference as ki

    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(M, D, F, dtype, seed)
    y, stats = twell_ffn_inference(x, wg, wu, wd, schedule="csr", hot_units=hot, return_stats=True)
    assert y.dtype == dtype and y.shape == x.shape and not torch.isnan(y).any()
    err, _ = _row_errors(y, x, wg, wu, wd)
    assert err.max() < ROW_TOL[dtype], (
        f"seed {seed}: worst row {int(err.argmax())} rel err {float(err.max()):.3g}"
    )
    if not hot:  # rows whose CSR end lies past the capacity
        ends = (x.double() @ wg.double().T > 0).sum(1).cumsum(0)
        assert int(stats.overflow_rows) == int((ends > ki.csr_capacity(M, F)).sum())


@pytest.mark.parametrize("hot", [0, 64])
def test_csr_positives_past_the_capacity_are_read_from_h(hot, monkeypatch, poisoned_empty):
    """A CSR far too small for the batch: rows (and the tail of a row) past its slots are walked from
    the dense h by the row kernel, exactly, and counted in overflow_rows."""
    import twell.kernels.inference.inference as ki

    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(67, 64, 320, torch.bfloat16, seed)
    monkeypatch.setattr(ki, "csr_capacity", lambda M, F: 37)  # cuts a row in the middle
    y, stats = twell_ffn_inference(x, wg, wu, wd, schedule="csr", hot_units=hot, return_stats=True)
    err, _ = _row_errors(y, x, wg, wu, wd)
    assert err.max() < ROW_TOL[torch.bfloat16], f"seed {seed}: rel err {float(err.max()):.3g}"
    ends = (x.double() @ wg.double().T > 0).sum(1).cumsum(0)  # CSR row ends without hot units
    if hot:
        assert int(stats.overflow_rows) >= 1  # the dense row alone has 256 cold positives
    else:
        assert int(stats.overflow_rows) == int((ends > 37).sum())


@pytest.mark.parametrize("P,ordered", [(64, True), (128, False), (320, True)])
def test_hot_prefix_matches_reference_on_hard_patterns(P, ordered, poisoned_empty):
    """hot_prefix=P: the first P units dense from h, the rest through the CSR (whose capacity these
    small batches overflow: the h walk must skip the prefix). Exact whatever the order (ordered:
    units stored most-firing first, as a model would after calibration; P = d_ff: all dense)."""
    from twell.kernels import unit_order

    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(67, 64, 320, torch.bfloat16, seed)
    if ordered:
        order = unit_order((x.float() @ wg.float().T > 0).sum(0))
        wg, wu, wd = (w[order].contiguous() for w in (wg, wu, wd))
    y, stats = twell_ffn_inference(x, wg, wu, wd, schedule="csr", hot_prefix=P, return_stats=True)
    err, _ = _row_errors(y, x, wg, wu, wd)
    assert not torch.isnan(y).any()
    assert err.max() < ROW_TOL[torch.bfloat16], f"seed {seed}: rel err {float(err.max()):.3g}"
    if P == 320:
        assert int(stats.overflow_rows) == 0


def test_hot_prefix_rejects_bad_values():
    x, w = torch.randn(80, 64), torch.randn(128, 64)
    for bad in (-32, 48, 160, True, 1.0):
        with pytest.raises(ValueError, match=r"hot_prefix=.* must be a multiple of 32 in \[0, d_ff=128\]"):
            twell_ffn_inference(x, w, w, w, hot_prefix=bad)
    with pytest.raises(ValueError, match="hot_prefix=64 and hot_units=8: choose one"):
        twell_ffn_inference(x, w, w, w, hot_prefix=64, hot_units=8)
    with pytest.raises(ValueError, match="hot_prefix=64 needs schedule='csr'"):
        twell_ffn_inference(x, w, w, w, hot_prefix=64, schedule="row")
    with pytest.raises(ValueError, match=r"fires must be per-unit counts \[d_ff\]"):
        from twell.kernels import unit_order

        unit_order(torch.ones(2, 3))


def test_csr_schedule_rejects_twell_options():
    x, w = torch.randn(4, 64), torch.randn(128, 64)
    with pytest.raises(ValueError, match="slots=8 is a TwELL option of schedule='row'"):
        twell_ffn_inference(x, w, w, w, schedule="csr", slots=8)


def test_decode_split_default_and_override():
    """The consumer's programs per row at decode sizes: 16 from 4 to 48 tokens, 8 otherwise (H200
    measurements in kernels.inference.inference.decode_split); set_decode_split pins one, None restores it."""
    from twell.kernels.inference.inference import decode_split, set_decode_split

    assert [decode_split(M) for M in (1, 2, 3, 4, 16, 48, 49, 64)] == [8, 8, 8, 16, 16, 16, 8, 8]
    set_decode_split(32)
    try:
        assert decode_split(1) == decode_split(16) == 32
    finally:
        set_decode_split(None)
    assert decode_split(16) == 16
    with pytest.raises(ValueError, match="decode split=0 must be >= 1"):
        set_decode_split(0)


def test_compiles_without_graph_breaks_through_its_custom_op():
    x, wg, wu, wd = paper_like_ffn_inputs(
        24, 64, 128, mean_active=6.0, dtype=torch.float32, device=DEVICE, seed=3
    )

    def block(x, wg, wu, wd):
        return x + twell_ffn_inference(torch.tanh(x) * 2, wg, wu, wd)  # ops around it in one graph

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(x, wg, wu, wd), block(x, wg, wu, wd), rtol=1e-5, atol=1e-6)
    torch.library.opcheck(
        torch.ops.twell.ffn_inference.default,
        (x, wg, wu, wd, -1, 0),
        test_utils=("test_schema", "test_faketensor"),
    )


# ---- schedule="fused": the decode FFN in one kernel (gate GEMV, gathers, atomics, last-ticket cast)


def _workspace_is_clean(x) -> bool:
    ticket, y32 = decode_fused.fused_workspace(x.device, x.shape[1])
    return int(ticket.item()) == 0 and not y32.any()


@pytest.mark.parametrize("loads", ["tma", "ptr"])
@pytest.mark.parametrize(
    "M,D,F,dtype",
    [
        (1, 64, 128, torch.bfloat16),
        (3, 128, 320, torch.bfloat16),
        (8, 64, 192, torch.float32),
        (5, 192, 256, torch.float32),
    ],
)
def test_fused_matches_reference_on_hard_patterns(loads, M, D, F, dtype, poisoned_empty, monkeypatch):
    """Silent, fully dense and heavy-tailed rows and a tile where every unit fires: no slots, so
    nothing overflows and every positive must reach y (y is poisoned: an unwritten element fails)."""
    if loads == "ptr":
        monkeypatch.setattr(decode_fused, "tma_ready", lambda *tensors: False)
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(M, D, F, dtype, seed)
    make_units_always_active(wg, slice(1, F, F // 64))  # every unit of program 1's interleaved slice
    x, wg, wu, wd = (t.to(DEVICE) for t in (x, wg, wu, wd))
    y, stats = twell_ffn_inference(x, wg, wu, wd, schedule="fused", return_stats=True)
    assert y.dtype == dtype and y.shape == x.shape
    assert not torch.isnan(y).any()
    err, _ = _row_errors(y, x, wg, wu, wd)
    assert err.max() < ROW_TOL[dtype], (
        f"seed {seed}: worst row {int(err.argmax())} rel err {float(err.max()):.3g}"
    )
    assert int(stats.overflow_rows) == 0
    assert _workspace_is_clean(x)  # the last program left ticket and fp32 rows ready for the next call


@pytest.mark.parametrize("tile", [16, 32])
@pytest.mark.parametrize("M,D,F,dtype", [(1, 64, 192, torch.bfloat16), (4, 128, 256, torch.float32)])
def test_fused_with_fewer_units_per_program_matches_reference(tile, M, D, F, dtype, poisoned_empty):
    """tile < 64: d_ff / tile programs share the gate GEMV (more of the GPU's SMs at decode sizes); each
    program's interleaved slice (units t, t + T, ...) again holds a unit that fires for every token."""
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = _hard_inputs(M, D, F, dtype, seed)
    make_units_always_active(wg, slice(1, F, F // tile))
    x, wg, wu, wd = (t.to(DEVICE) for t in (x, wg, wu, wd))
    workspace = decode_fused.fused_workspace(x.device, D)
    y = decode_fused.fused_ffn_decode(x, wg, wu, wd, workspace, tile=tile)
    err, _ = _row_errors(y, x, wg, wu, wd)
    assert err.max() < ROW_TOL[dtype], (
        f"seed {seed}, tile {tile}: worst row {int(err.argmax())} rel err {float(err.max()):.3g}"
    )
    assert _workspace_is_clean(x)
    with pytest.raises(ValueError, match="tile=48 must be one of"):
        decode_fused.fused_ffn_decode(x, wg, wu, wd, workspace, tile=48)


def test_fused_calls_in_a_row_share_the_workspace():
    """Calls of other widths and batch sizes in between (another program count on the same ticket,
    another d_model's workspace) leave every result exact; the same inputs give the same y up to the
    order of the fp32 sum (bit for bit under the interpreter, which runs programs in order)."""
    seed = int(torch.randint(0, 2**31, ()).item())
    x, wg, wu, wd = (t.to(DEVICE) for t in _hard_inputs(4, 64, 256, torch.bfloat16, seed))
    first = twell_ffn_inference(x, wg, wu, wd, schedule="fused")
    for M, D, F in ((2, 64, 448), (7, 128, 192), (1, 64, 256)):
        other = paper_like_ffn_inputs(M, D, F, mean_active=12, dtype=torch.bfloat16, seed=seed, device=DEVICE)
        err, _ = _row_errors(twell_ffn_inference(*other, schedule="fused"), *other)
        assert err.max() < ROW_TOL[torch.bfloat16], f"seed {seed}: {(M, D, F)} rel err {float(err.max()):.3g}"
    again = twell_ffn_inference(x, wg, wu, wd, schedule="fused")
    if DEVICE == "cpu":
        assert torch.equal(first, again)
    else:
        torch.testing.assert_close(first, again, rtol=2**-7, atol=1e-5)
    assert _workspace_is_clean(x)


def test_fused_all_silent_batch_gives_zeros():
    x, wg, wu, wd = (t.to(DEVICE) for t in paper_like_ffn_inputs(2, 64, 128, dtype=torch.float32, seed=3))
    wg = -wg.abs()
    x = x.abs()  # every pre-activation <= 0: no slice adds anything
    y = twell_ffn_inference(x, wg, wu, wd, schedule="fused")
    assert torch.equal(y, torch.zeros_like(y))


def test_fused_rejects_what_it_cannot_take():
    x, wg, wu, wd = (t.to(DEVICE) for t in paper_like_ffn_inputs(9, 64, 128, seed=1))
    with pytest.raises(ValueError, match="schedule='fused' takes at most 8 tokens, got 9"):
        twell_ffn_inference(x, wg, wu, wd, schedule="fused")
    with pytest.raises(ValueError, match="slots=8 is a TwELL option of schedule='row'"):
        twell_ffn_inference(x[:2], wg, wu, wd, schedule="fused", slots=8)
    with pytest.raises(ValueError, match="hot_units=-1 must be an integer >= 0"):
        twell_ffn_inference(x[:2], wg, wu, wd, schedule="fused", hot_units=-1)


def _count_fused_calls(monkeypatch) -> list[int]:
    """The token counts of the calls that reach the fused kernel from here on (they still run)."""
    from twell.kernels.inference import inference

    calls = []
    real = inference.fused_ffn_decode
    monkeypatch.setattr(inference, "fused_ffn_decode", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    return calls


def test_default_schedule_takes_fused_up_to_its_bound(monkeypatch):
    """Up to DEFAULT_FUSED_TOKENS tokens the default call is the fused kernel; past it, with a TwELL
    option, or under torch.use_deterministic_algorithms(True) the row schedule (and an explicit
    schedule='fused' is refused there, naming the fix)."""
    from twell.kernels.inference import inference

    monkeypatch.setattr(inference, "DEFAULT_FUSED_TOKENS", 2)
    x, wg, wu, wd = (t.to(DEVICE) for t in paper_like_ffn_inputs(3, 64, 192, dtype=torch.bfloat16, seed=5))
    calls = _count_fused_calls(monkeypatch)
    y2 = twell_ffn_inference(x[:2], wg, wu, wd)
    twell_ffn_inference(x, wg, wu, wd)
    twell_ffn_inference(x[:2], wg, wu, wd, slots=8)
    assert calls == [2]
    err, _ = _row_errors(y2, x[:2], wg, wu, wd)
    assert err.max() < ROW_TOL[torch.bfloat16]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        twell_ffn_inference(x[:2], wg, wu, wd)
        assert calls == [2]
        with pytest.raises(RuntimeError, match="use schedule='row'"):
            twell_ffn_inference(x[:2], wg, wu, wd, schedule="fused")
    finally:
        torch.use_deterministic_algorithms(was)


def test_default_fused_bound_grows_with_d_ff(monkeypatch):
    """From WIDE_FUSED_D_FF units the default call takes the fused kernel up to WIDE_FUSED_TOKENS tokens
    (measured on the H200: d_ff 8192 at 4 tokens), below it up to DEFAULT_FUSED_TOKENS."""
    from twell.kernels.inference import inference

    assert inference.default_fused_tokens(5632) == 2 and inference.default_fused_tokens(8192) == 4
    monkeypatch.setattr(inference, "WIDE_FUSED_D_FF", 256)  # the rule at CPU-test widths
    calls = _count_fused_calls(monkeypatch)
    for F in (192, 256):
        x, wg, wu, wd = (t.to(DEVICE) for t in paper_like_ffn_inputs(5, 64, F, dtype=torch.bfloat16, seed=F))
        for M in (2, 3, 4, 5):
            y = twell_ffn_inference(x[:M], wg, wu, wd)
            err, _ = _row_errors(y, x[:M], wg, wu, wd)
            assert err.max() < ROW_TOL[torch.bfloat16], f"d_ff {F}, {M} tokens: {float(err.max()):.3g}"
    assert calls == [2, 2, 3, 4]  # d_ff 192: fused at 2 tokens only; 256: up to 4


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 8])
def test_fused_replays_in_a_cuda_graph(M):
    """Warmed up on the capture stream (its workspace exists): the graph holds the fused kernel, and
    every replay on new inputs is exact and matches an eager call (up to the fp32 sum's order). A
    capture on a stream without a workspace takes the row schedule (no fill node) and is exact too."""
    x, wg, wu, wd = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=M)
    static_x = x.clone()
    graphs = {}
    for warm in (True, False):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            if warm:
                twell_ffn_inference(static_x, wg, wu, wd, schedule="fused")
            else:
                twell_ffn_inference(static_x, wg, wu, wd, schedule="row")  # compile outside the capture
            with torch.cuda.graph(graph, stream=stream):
                y = twell_ffn_inference(static_x, wg, wu, wd, schedule="fused")
        torch.cuda.current_stream().wait_stream(stream)
        graphs[warm] = (graph, y)
    for seed in (1, 2):
        fresh = paper_like_ffn_inputs(M, 2048, 5632, device="cuda", seed=1000 * seed + M)[0]
        static_x.copy_(fresh)
        ref = (
            (torch.relu(fresh.float() @ wg.float().T) * (fresh.float() @ wu.float().T)) @ wd.float()
        ).double()
        for warm, (graph, y) in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)
            assert err.max() < 1e-2, f"warm={warm}: {float(err.max()):.3g}"
        eager = twell_ffn_inference(fresh, wg, wu, wd, schedule="fused")
        torch.testing.assert_close(graphs[True][1], eager, rtol=2**-7, atol=1e-5)
    assert _workspace_is_clean(x)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 8])
def test_fused_at_paper_shapes(M):
    """d 2048, d_ff 5632 and 8192 (88 / 128 programs), paper-like rows plus a fully dense one."""
    from twell.kernels.synthetic import make_rows_dense

    for F in (5632, 8192):
        x, wg, wu, wd = paper_like_ffn_inputs(M, 2048, F, device="cuda", seed=M + F)
        make_rows_dense(x, [M // 2])
        y = twell_ffn_inference(x, wg, wu, wd, schedule="fused")
        ref = ((torch.relu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)) @ wd.float()).double()
        err = (y.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-3)
        assert err.max() < 1e-2, f"d_ff {F}: worst row {int(err.argmax())}: {float(err.max()):.3g}"
