"""The decode FFN in one kernel (schedule "fused", up to 8 tokens): gate GEMV, gathers and sums, one launch.

One program per slice of 64 units of d_ff (program t takes units t, t + T, t + 2T, ... of the T = d_ff / 64
programs, so that units ordered by firing rate spread over every program) computes the slice's gate
pre-activations for all tokens (a TMA GEMV: the whole batch is one 16-row tile), then walks its units that
fire for any token, CH at a time: their w_up and w_down rows are loaded once (one memory round trip
for every token of the batch), and each token that uses one of them adds its partial row
sum_j g_j (x . w_up[j]) w_down[j] into an fp32 row with atomics. No TwELL format leaves the program,
so no tile can overflow: every positive is used. The last program to finish (a ticket) casts the fp32
rows to y in x's dtype and zeroes them again. One kernel where the row schedule launches two (gate,
consumer): a kernel boundary inside a CUDA graph costs ~2 us, a tenth of a 1-token FFN. The atomics
make the order of the fp32 sum vary from run to run (the last bit of y may differ); under
torch.use_deterministic_algorithms(True) the default takes the row schedule.

The workspace (a ticket and the fp32 rows) is the only state kept between calls: one per (device,
stream, d_model), zeroed once when first used there and left zeroed by every call. A call made while a
CUDA graph is being captured on a stream without one takes the row schedule instead (creating it would
put a fill into the graph); warm up on the capture stream to get the fused kernel in the graph. A
graph keeps the workspace of the stream it was captured on: do not replay it while fused calls on that
stream, or replays of other graphs captured there, may run at the same time (they would add into the
same fp32 rows). Sequential replays, on any stream, are safe.

The walk's shape was measured against three masked-load tensor-core GEMMs per slice: those were slower
at every batch size, their K and d_model loops being chains of small dependent loads (NOTES round 17).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import autotune, dot_in_fp32, dot_precision, interpreting, next_pow2, tma_ready
from ..gate_gemm import gate_tile_preact

FUSED_TILE_N = 64  # units per program by default: F / 64 programs (88 at d_ff 5632), as the decode TwELL gate
FUSED_TILES = (16, 32, 64)  # the units per program a call may ask for (tl.dot's N is at least 16)

GATE_BLOCK_M = 16  # the batch is one row tile of the gate GEMV (16: tl.dot's smallest)
# The last program's [M, d_model] read of y32 stays in registers (the default call stops earlier:
# kernels.inference.inference.default_fused_tokens).
FUSED_MAX_TOKENS = 8


@triton.jit
def _fused_decode_kernel(
    x_src,
    w_src,
    x_ptr,
    wu_ptr,
    wd_ptr,
    y_ptr,
    y32_ptr,
    ticket_ptr,
    M,
    F,
    T,
    M_BUCKET,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    M_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CH: tl.constexpr,
    TMA: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    DYNAMIC_LOOPS: tl.constexpr,
):
    # x_src / w_src: TMA descriptors of x and w_gate when TMA, else the pointers. M_BUCKET keys tuning.
    # Program `tile` takes the units tile, tile + T, tile + 2T, ... (T = F / TILE_N programs): units
    # ordered by firing rate (Transformer.order_ffn_units) put the hottest ones first, and contiguous
    # slices would hand them all to the first programs, whose walks then set the kernel's time.
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    js = tl.arange(0, TILE_N)
    cols = js * T + tile
    if TMA:  # w_src: w_gate viewed as [TILE_N, T, D], one [TILE_N, 1, BLOCK_K] box per K step
        pre = tl.zeros((BLOCK_M, TILE_N), dtype=tl.float32)
        for k in range(0, D, BLOCK_K):
            a = x_src.load([0, k])
            b = tl.reshape(w_src.load([0, tile, k]), (TILE_N, BLOCK_K))
            if DOT_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            pre = tl.dot(a, b.T, pre, input_precision=PRECISION)
    else:
        pre = gate_tile_preact(
            x_src, w_src, rows, cols, M, F, D, BLOCK_M, TILE_N, BLOCK_K, DOT_FP32, PRECISION
        )
    live_tile = (pre > 0) & (rows[:, None] < M)  # cols < F = T * TILE_N always
    # Gate values rounded to x's dtype, as the TwELL format stores them (both schedules agree).
    g = tl.where(live_tile, pre, 0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    lanes = tl.arange(0, CH)
    # The units live for any token, CH per chunk: their weight rows are loaded once (one round
    # trip; measured 1-2.6 us a layer faster at 2-8 tokens than a walk token by token, NOTES round 16)
    # and every token that uses one of them adds its row from registers.
    ms = tl.arange(0, M_PAD)
    m_ok = ms < M
    union = (tl.sum(live_tile.to(tl.int32), axis=0) > 0).to(tl.int32)  # [TILE_N]
    n_u = tl.sum(union, axis=0)
    if n_u > 0:
        rank = tl.cumsum(union, axis=0) - 1
        xs = tl.load(x_ptr + ms[:, None] * D + ds[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        for c0 in range(0, n_u if DYNAMIC_LOOPS else TILE_N, CH):  # (interpreter: every lane, masked)
            sel = (union[None, :] > 0) & (rank[None, :] == (c0 + lanes)[:, None])  # [CH, TILE_N]
            unit = tile + T * tl.sum(tl.where(sel, js[None, :], 0), axis=1)
            ok = (c0 + lanes) < n_u
            w_off = unit.to(tl.int64)[:, None] * D + ds[None, :]
            both = ok[:, None] & d_ok[None, :]
            wu = tl.load(wu_ptr + w_off, mask=both, other=0.0).to(tl.float32)
            wd = tl.load(wd_ptr + w_off, mask=both, other=0.0).to(tl.float32)
            for m in range(M if DYNAMIC_LOOPS else M_PAD):
                g_m = tl.sum(tl.where(rows[:, None] == m, g, 0.0), axis=0)  # [TILE_N]
                gate = tl.sum(tl.where(sel, g_m[None, :], 0.0), axis=1)  # [CH]: 0 where m is silent
                if tl.sum((gate > 0).to(tl.int32), axis=0) > 0:
                    x_m = tl.sum(tl.where(ms[:, None] == m, xs, 0.0), axis=0).to(tl.float32)
                    h = gate * tl.sum(wu * x_m[None, :], axis=1)
                    contrib = tl.sum(h[:, None] * wd, axis=0)
                    tl.atomic_add(y32_ptr + m * D + ds, contrib, mask=d_ok, sem="relaxed")
    # Every thread's atomics are ordered before thread 0's release of the ticket (bar.sync, then the
    # acq_rel atomic): the program that draws the last ticket sees every slice's contribution.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == T - 1:
        off = ms[:, None] * D + ds[None, :]
        both = m_ok[:, None] & d_ok[None, :]
        y = tl.load(y32_ptr + off, mask=both, other=0.0, cache_modifier=".cg")  # L2, where atomics land
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=both)
        tl.store(y32_ptr + off, tl.zeros((M_PAD, BLOCK_D), dtype=tl.float32), mask=both)
        tl.atomic_xchg(ticket_ptr, 0)  # ready for the next call on this stream


def _set_desc_blocks(nargs):
    """Autotune pre-hook: the TMA descriptors carry the config's block shape."""
    if nargs["TMA"]:
        nargs["x_src"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["w_src"].block_shape = [nargs["TILE_N"], 1, nargs["BLOCK_K"]]


def _fused_configs() -> list[triton.Config]:
    # The decode gate's table (deep pipelines of wide K steps for the GEMV); CH weight rows per gather.
    return [
        triton.Config({"CH": ch}, num_warps=w, num_stages=s, pre_hook=_set_desc_blocks)
        for w, s, ch in ((4, 4, 4), (8, 4, 4), (4, 6, 4), (8, 6, 8))
    ]


_tuned_fused = autotune(configs=_fused_configs(), key=["M_BUCKET", "F", "D", "BLOCK_K", "TMA", "TILE_N"])(
    _fused_decode_kernel
)

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def fused_workspace(device: torch.device, D: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ticket int32 [1], y32 fp32 [FUSED_MAX_TOKENS, D]) of the current stream of `device`, created
    zeroed on first use (the kernel leaves both zeroed), or None while that stream is capturing a CUDA
    graph and has none (the caller takes the row schedule: a fill would join the graph)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream, D)
    ws = _workspaces.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ws = _workspaces[key] = (
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros((FUSED_MAX_TOKENS, D), dtype=torch.float32, device=device),
        )
    return ws


def fused_ffn_decode(x, w_gate, w_up, w_down, workspace, tile: int | None = None) -> torch.Tensor:
    """y of the FFN for M <= FUSED_MAX_TOKENS rows in one kernel (checks of the operands, the token bound
    included, are the caller's; `workspace` from fused_workspace). tile: units per program, one of
    FUSED_TILES (None: FUSED_TILE_N; fewer units a program: more programs for the gate GEMV, d_ff / tile
    of them)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tile = FUSED_TILE_N if tile is None else tile
    if tile not in FUSED_TILES:
        raise ValueError(f"fused_tile={tile!r} must be one of {FUSED_TILES} (units of d_ff per program)")
    M, D = x.shape
    F = w_gate.shape[0]
    ticket, y32 = workspace
    T = F // tile  # d_ff is a multiple of 64 (check_x_weight): program t takes units t + T j
    tma = tma_ready(x, w_gate)  # TMA loads for the gate GEMV (Hopper+, aligned), else pointer loads
    # 128-wide K steps (the decode gate's); pointer loads need D % BLOCK_K == 0
    block_k = 128 if D % 128 == 0 and not interpreting() else 64
    if tma:
        x_src = TensorDescriptor.from_tensor(x, [GATE_BLOCK_M, block_k])
        w_src = TensorDescriptor.from_tensor(w_gate.view(tile, T, D), [tile, 1, block_k])
    else:
        x_src, w_src = x, w_gate
    y = torch.empty((M, D), dtype=x.dtype, device=x.device)
    args = (x_src, w_src, x, w_up, w_down, y, y32, ticket, M, F, T, next_pow2(M))
    common = dict(
        D=D,
        BLOCK_D=next_pow2(D),
        BLOCK_M=GATE_BLOCK_M,
        M_PAD=next_pow2(M),
        TILE_N=tile,
        BLOCK_K=block_k,
        TMA=tma,
        DOT_FP32=dot_in_fp32(x.dtype),
        PRECISION=dot_precision(x.dtype),
    )
    if interpreting():
        _fused_decode_kernel[(T,)](*args, CH=4, DYNAMIC_LOOPS=False, **common)
    else:
        _tuned_fused[(T,)](*args, DYNAMIC_LOOPS=True, **common)
    return y
