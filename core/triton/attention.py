"""Attention of one-row queries over the slot-based KV pool, in Triton.

The layout is the CPU kernel's (``backends/kernel_attention.py``), per query row instead of per
group: row ``r`` (query ``row_q[r]``) attends to ``seg_len[r]`` slots from ``slots[seg_start[r]:]``
followed by ``ext_len[r]`` slots from ``ext_slots[ext_start[r]:]`` -- for a decode row its prefix
and itself, for a tree row the request's prefix and its visible tree nodes (ancestors, itself
last), for a prompt or extend row the sequence's slots up to and including its own (causal,
without listing them per row). One program per (row, KV head) walks the row's keys in cache
order for the query heads that share that KV head (GQA: head ``h`` reads KV head ``h // group``;
each K/V block is read once for the group), ``BLOCK_N`` at a time over the row's concatenated key
index (so the block boundaries do not depend on where its prefix ends), with an online softmax in
fp32: a row's bits never depend on what else is in the forward, and a tree node's output equals the
plain decode step of the same token (batch invariant by construction, as the CPU kernel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ..backends.row_layout import RowLayout


@triton.jit
def _row_attention_kernel(
    Q, K, V, O, scale,
    row_q, seg_start, seg_len, ext_start, ext_len, slots, ext_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP
    h = kvh * GROUP + g  # the query heads that read KV head kvh
    t = tl.load(row_q + r)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qo_mask = gm[:, None] & dm[None, :]
    q = tl.load(Q + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0).to(tl.float32)
    s0 = tl.load(seg_start + r)
    n0 = tl.load(seg_len + r)
    e0 = tl.load(ext_start + r)
    n = n0 + tl.load(ext_len + r)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, n, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        valid = j < n
        in_seg = j < n0
        a = tl.load(slots + s0 + j, mask=valid & in_seg, other=0)
        b = tl.load(ext_slots + e0 + (j - n0), mask=valid & (j >= n0), other=0)
        slot = tl.where(in_seg, a, b).to(tl.int64)
        kv_mask = valid[:, None] & dm[None, :]
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty), mask=qo_mask)


def row_attention(q, k_cache, v_cache, out, scale: float, layout: "RowLayout", block_n: int = 32) -> torch.Tensor:
    """``out[row_q[r], h] = softmax(q k^T * scale) v`` over row ``r``'s keys (``RowLayout``) for
    every row and head; rows of ``out`` no row names are left as they are."""
    T, H, D = q.shape
    if layout.rows == 0:
        return out
    kv_heads = k_cache.shape[1]
    group = H // kv_heads
    _row_attention_kernel[(layout.rows, kv_heads)](
        q, k_cache, v_cache, out, float(scale),
        layout.row_q, layout.seg_start, layout.seg_len, layout.ext_start, layout.ext_len, layout.slots, layout.ext_slots,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n,
    )  # fmt: skip
    return out
