"""Moving KV entries between slots for every layer at once, in Triton: after a verify, the
scheduler moves each request's accepted tree path to the front of its reservation
(``Scheduler._keep_kv``, ``KVPool.move``); the torch path is two ops per layer for K and V each
(~120 launches on a 30-layer model), this is one launch.

Kept entries come in tree order, so ``dst[i] <= src[i]`` and no source is overwritten before it
is read when the pairs are copied in order (``src[j]`` is ``slots[keep[j]]`` with ``keep[j] >=
j``; a write to ``dst[i] = slots[i]`` with ``i < j`` never hits it): each program copies one
(layer, K or V, block of head elements) through every pair in order.
``KVPool.move``'s loop (index_select, then index_copy) is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _move_kv_kernel(K, V, src, dst, n_pairs, stride_layer, stride_slot, ROW: tl.constexpr, BLOCK: tl.constexpr):
    layer = tl.program_id(0)
    which = tl.program_id(1)
    blk = tl.program_id(2)
    e = blk * BLOCK + tl.arange(0, BLOCK)
    m = e < ROW
    base_k = K + layer * stride_layer
    base_v = V + layer * stride_layer
    for i in range(n_pairs):
        s = tl.load(src + i).to(tl.int64)
        d = tl.load(dst + i).to(tl.int64)
        if which == 0:
            x = tl.load(base_k + s * stride_slot + e, mask=m)
            tl.store(base_k + d * stride_slot + e, x, mask=m)
        else:
            x = tl.load(base_v + s * stride_slot + e, mask=m)
            tl.store(base_v + d * stride_slot + e, x, mask=m)


def move_kv(k_all: torch.Tensor, v_all: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, block: int = 256) -> None:
    """``k_all``/``v_all`` [layers, slots, kv_heads, head_dim] (contiguous); pairs in tree order."""
    n = int(src.numel())
    if n == 0:
        return
    L, _, H, D = k_all.shape
    row = H * D
    grid = (L, 2, triton.cdiv(row, block))
    _move_kv_kernel[grid](k_all, v_all, src.to(torch.int32), dst.to(torch.int32), n, k_all.stride(0), k_all.stride(1), ROW=row, BLOCK=block)
