"""Attention of a one-token decode step over a static KV cache (flash-decoding): split the keys, combine.

A decode step's attention reads every cached key and value of its rows once and does almost no arithmetic:
its cost is the bytes of the slots each row attends to and how many SMs share them. One program per
(row, KV head, split of the keys) walks its split with an online softmax -- only up to the row's own
position, so slots past it (the rest of a row's prompt padding, the cache's unused tail) are never read --
and writes an unnormalised partial; a second kernel combines the splits of each (row, head). The splits
are chosen from the shapes alone (enough programs to cover the GPU at batch 1), so a CUDA graph of the
step keeps one launch configuration. Query heads that share a KV head (grouped-query attention) are
handled by the program of that KV head, which loads each key and value once for all of them.

Inputs as the model's decode step has them (model/layers.py, model/kv_cache.py): q [B, H, 1, hd] after
RoPE, the layer's cache k, v [B, Hkv, max_len, hd], positions int64 [B] (row b attends to slots 0 ..
positions[b], the slot its new token was just written to).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import cdiv, interpreting, next_pow2

TARGET_PROGRAMS = 264  # two per SM of an H100 / H200: splits = programs wanted / (rows x KV heads)
MIN_SPLIT_KEYS = 64  # no split shorter than this many slots


@triton.jit
def _partial_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr,
    sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
    scale,
    CHUNK: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, DYNAMIC_LOOPS: tl.constexpr,
):  # fmt: skip
    bk = tl.program_id(0)
    split = tl.program_id(1)
    b = bk // HKV
    kvh = bk % HKV
    last = tl.load(pos_ptr + b)  # attend to slots 0 .. last
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, last + 1)
    gs = tl.arange(0, G_PAD)
    g_ok = gs < G
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < HD
    heads = kvh * G + gs
    q = tl.load(
        q_ptr + b * sq_b + heads[:, None] * sq_h + ds[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )
    q = q.to(tl.float32) * scale
    m = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), dtype=tl.float32)
    k_base = k_ptr + b.to(tl.int64) * sk_b + kvh * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + kvh * sv_h
    for n0 in range(0, end - start if DYNAMIC_LOOPS else CHUNK, BLOCK_N):  # interpreter: masked lanes
        ns = start + n0 + tl.arange(0, BLOCK_N)
        n_ok = ns < end
        both = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + ns[:, None] * sk_s + ds[None, :], mask=both, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no key: exp(-inf) = 0, no NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(v_base + ns[:, None] * sv_s + ds[None, :], mask=both, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    # partials of (row b, head h, split): acc [.., BLOCK_D], then m and l side by side
    row = (b * HKV * G + heads).to(tl.int64) * SPLITS + split
    tl.store(acc_ptr + row[:, None] * BLOCK_D + ds[None, :], acc, mask=g_ok[:, None])
    tl.store(ml_ptr + row * 2, m, mask=g_ok)
    tl.store(ml_ptr + row * 2 + 1, l, mask=g_ok)


@triton.jit
def _combine_kernel(
    acc_ptr, ml_ptr, o_ptr, so_b, so_h,
    H: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    ss = tl.arange(0, SPLITS_PAD)
    s_ok = ss < SPLITS
    rows = bh.to(tl.int64) * SPLITS + ss
    m = tl.load(ml_ptr + rows * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ml_ptr + rows * 2 + 1, mask=s_ok, other=0.0)
    ds = tl.arange(0, BLOCK_D)
    acc = tl.load(acc_ptr + rows[:, None] * BLOCK_D + ds[None, :], mask=s_ok[:, None], other=0.0)
    top = tl.max(m, axis=0)  # finite: split 0 always holds slot 0
    w = tl.where(s_ok, tl.exp(m - top), 0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(o_ptr + b * so_b + h * so_h + ds, out.to(o_ptr.dtype.element_ty), mask=ds < HD)


def decode_splits(rows_x_heads: int, max_len: int) -> int:
    """Key splits per (row, KV head): enough programs to cover the GPU, none shorter than MIN_SPLIT_KEYS."""
    return max(1, min(cdiv(TARGET_PROGRAMS, rows_x_heads), cdiv(max_len, MIN_SPLIT_KEYS)))


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, splits: int | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v for one query token per row over the cache slots 0 .. positions[b]:
    q [B, H, 1, hd], k and v [B, Hkv, max_len, hd] (H a multiple of Hkv; k and v with a contiguous last dim), positions
    int [B] -> [B, H, 1, hd] in q's dtype. splits: key splits per (row, KV head) (None: decode_splits)."""
    B, H, S, HD = q.shape
    if S != 1:
        raise ValueError(f"decode_attention takes one query token per row, got q of shape {tuple(q.shape)}")
    Bk, HKV, L, HDk = k.shape
    if k.shape != v.shape or Bk != B or HDk != HD or H % HKV:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [B={B}, Hkv, max_len, hd={HD}] with "
            f"H={H} a multiple of Hkv"
        )
    if positions.shape != (B,):
        raise ValueError(f"positions must hold one slot per row ([{B}]), got shape {tuple(positions.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last (head) dimension, as the KV cache's views have")
    if q.stride(-1) != 1:
        q = q.contiguous()
    G = H // HKV
    splits = decode_splits(B * HKV, L) if splits is None else splits
    chunk = cdiv(cdiv(L, splits), 16) * 16
    block_d = next_pow2(HD)
    g_pad = next_pow2(G)
    block_n = max(16, min(64, 8192 // (g_pad * block_d)))
    acc = torch.empty((B * H * splits, block_d), dtype=torch.float32, device=q.device)
    ml = torch.empty((B * H * splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, 1, HD), dtype=q.dtype, device=q.device)
    _partial_kernel[(B * HKV, splits)](
        q, k, v, positions, acc, ml,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        HD**-0.5,
        CHUNK=chunk, HKV=HKV, G=G, G_PAD=g_pad, HD=HD, BLOCK_D=block_d, BLOCK_N=block_n, SPLITS=splits,
        DYNAMIC_LOOPS=not interpreting(),
    )  # fmt: skip
    _combine_kernel[(B * H,)](
        acc, ml, out, out.stride(0), out.stride(1),
        H=H, HD=HD, BLOCK_D=block_d, SPLITS=splits, SPLITS_PAD=next_pow2(splits),
    )  # fmt: skip
    return out


@torch.library.custom_op("twell::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """decode_attention as torch.compile sees it: one opaque node of the compiled decode block."""
    return decode_attention(q, k, v, positions)


@_decode_attention_op.register_fake
def _(q, k, v, positions):
    return q.new_empty(q.shape)
