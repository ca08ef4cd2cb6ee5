"""Re-initialisation of dead gate rows in place: W[j] <- (1 - lam) W[j] + lam sigma z, z ~ N(0, 1), for the
rows j flagged dead, and the same rows of the optimizer's moments zeroed, in one kernel per weight.

The noise is Philox keyed by (seed, global element index j * d_model + c): a function of the seed and the
element alone, so every data-parallel rank draws the same numbers without communication and a shard of the
rows (FSDP2 shards the units, dim 0) draws exactly the numbers the whole matrix would. Only dead rows are
read or written: a program whose rows are all alive returns after loading their flags, so the cost follows
the dead rows, not the matrix (the PyTorch version draws and blends all of d_ff x d_model every step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_pow2
from ._launch import fast

ROWS_PER_PROGRAM = 4
MAX_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq; further same-shape state is zeroed by the caller


@triton.jit(do_not_specialize=["seed"])
def _reinit_rows_kernel(
    w_ptr,
    m1_ptr,
    m2_ptr,
    dead_ptr,
    rows_ptr,
    n_rows,
    seed,
    keep,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    GLOBAL_ROWS: tl.constexpr,
    N_MOMENTS: tl.constexpr,
):
    # rows_ptr (GLOBAL_ROWS): the global index of each local row (a shard's rows); else local = global.
    local = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = local < n_rows
    dead = tl.load(dead_ptr + local, mask=r_ok, other=0) != 0
    if tl.sum(dead.to(tl.int32), axis=0) > 0:
        if GLOBAL_ROWS:
            glob = tl.load(rows_ptr + local, mask=r_ok, other=0).to(tl.int64)
        else:
            glob = local.to(tl.int64)
        live = dead & r_ok
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = live[:, None] & (cols < D)[None, :]
            offs = local.to(tl.int64)[:, None] * D + cols[None, :]
            z = tl.randn(seed, glob[:, None] * D + cols[None, :])
            w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(w_ptr + offs, (keep * w + scale * z).to(w_ptr.dtype.element_ty), mask=ok)
            if N_MOMENTS >= 1:
                tl.store(m1_ptr + offs, tl.zeros((ROWS, BLOCK_D), dtype=m1_ptr.dtype.element_ty), mask=ok)
            if N_MOMENTS >= 2:
                tl.store(m2_ptr + offs, tl.zeros((ROWS, BLOCK_D), dtype=m2_ptr.dtype.element_ty), mask=ok)


_REINIT_ROWS = fast(_reinit_rows_kernel)


def philox_seed(seed: int, step: int, layer: int) -> int:
    """The noise stream of (run seed, optimizer step, layer), a non-negative 63-bit integer."""
    return ((seed * 1_000_003 + step) * 1_009 + layer) & ((1 << 63) - 1)


def reinit_rows_(
    weight: torch.Tensor,
    dead: torch.Tensor,
    seed: int,
    lam: float,
    sigma: float,
    moments: tuple[torch.Tensor, ...] = (),
    rows: torch.Tensor | None = None,
) -> None:
    """In place, for every local row j of weight [R, D] with dead[j]: weight[j] <- (1 - lam) weight[j] +
    lam sigma z (z Philox-normal, keyed by `seed` and the element's global index rows[j] * D + c) and
    every tensor of `moments` ([R, D] each, at most MAX_MOMENTS) zeroed on row j.

    dead: bool [R] (the local rows' flags). rows: int [R], the global row of each local row (a shard
    of a larger weight); None: the local rows are the global ones. No host sync."""
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous 2-D tensor, got shape {tuple(weight.shape)}")
    R, D = weight.shape
    if dead.shape != (R,):
        raise ValueError(f"dead must be [rows]={R} flags, got shape {tuple(dead.shape)}")
    if rows is not None and rows.shape != (R,):
        raise ValueError(
            f"rows must hold the global index of each of the {R} local rows, got {tuple(rows.shape)}"
        )
    if len(moments) > MAX_MOMENTS:
        raise ValueError(
            f"at most {MAX_MOMENTS} moments a call, got {len(moments)}; zero the rest with torch"
        )
    for m in moments:
        if m.shape != weight.shape or not m.is_contiguous() or m.device != weight.device:
            raise ValueError(
                f"a moment of shape {tuple(m.shape)} does not match the weight {tuple(weight.shape)}"
            )
    if R == 0:
        return
    padded = (*moments, weight, weight)[:MAX_MOMENTS]  # unused pointers: never written (N_MOMENTS)
    _REINIT_ROWS[(cdiv(R, ROWS_PER_PROGRAM),)](
        weight,
        *padded,
        dead.view(torch.uint8) if dead.dtype == torch.bool else dead,
        weight if rows is None else rows,
        R,
        seed,
        1.0 - lam,
        lam * sigma,
        D=D,
        BLOCK_D=min(next_pow2(D), 1024),
        ROWS=ROWS_PER_PROGRAM,
        GLOBAL_ROWS=rows is not None,
        N_MOMENTS=len(moments),
    )
