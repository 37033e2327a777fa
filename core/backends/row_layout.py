"""Per-row key lists of a forward for attention kernels that run one program per query row
(``triton/attention.py``), built once per forward from the host slot lists (``SeqSpan``).

Row ``r`` is query ``row_q[r]``; its keys, in cache order, are ``seg_len[r]`` slots of ``slots``
from ``seg_start[r]`` on, then ``ext_len[r]`` slots of ``ext_slots`` from ``ext_start[r]`` on:

* causal rows (prompt prefill, extend, plain decode: ``tree_mask`` None): the sequence's slots up
  to and including the row's own -- one segment of ``slots`` shared by all its rows, no extras;
* tree rows: the request's prefix (shared segment), then the row's visible tree nodes (its
  ``tree_mask`` row over the last ``m`` slots: ancestors first, itself last) as extras.

Pure torch (host), so the layout is tested without Triton; ``reference_attention`` is the float64
reference the kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward_batch import SeqSpan


@dataclass
class RowLayout:
    row_q: torch.Tensor  # int32 [R]
    seg_start: torch.Tensor  # int32 [R]
    seg_len: torch.Tensor  # int32 [R]
    ext_start: torch.Tensor  # int32 [R]
    ext_len: torch.Tensor  # int32 [R]
    slots: torch.Tensor  # int32 [S]: every sequence's kv_slots, concatenated
    ext_slots: torch.Tensor  # int32 [E]: tree rows' visible nodes, row after row

    @property
    def rows(self) -> int:
        return int(self.row_q.numel())

    @classmethod
    def build(cls, seqs: list[SeqSpan]) -> "RowLayout":
        row_q, seg_start, seg_len, ext_start, ext_len, slots, extras = [], [], [], [], [], [], []
        base = ebase = 0
        for s in seqs:
            n, P = int(s.kv_slots.numel()), s.prefix_len
            slots.append(s.kv_slots)
            rows = torch.arange(s.q_start, s.q_start + s.q_len)
            row_q.append(rows)
            seg_start.append(torch.full((s.q_len,), base))
            if s.tree_mask is None:
                seg_len.append(torch.arange(P + 1, P + s.q_len + 1))
                ext_start.append(torch.full((s.q_len,), ebase))
                ext_len.append(torch.zeros(s.q_len, dtype=torch.long))
            else:
                tm = s.tree_mask
                m = tm.shape[1]
                seg_len.append(torch.full((s.q_len,), n - m))
                counts = tm.sum(1)
                extras.append(s.kv_slots[n - m :].expand(s.q_len, m)[tm])  # row-major: row 0's, row 1's, ...
                ext_start.append(ebase + torch.cumsum(counts, 0) - counts)
                ext_len.append(counts)
                ebase += int(counts.sum())
            base += n
        i32 = lambda parts: torch.cat(parts).to(torch.int32) if parts else torch.zeros(0, dtype=torch.int32)  # noqa: E731
        ext = i32(extras)
        return cls(
            i32(row_q), i32(seg_start), i32(seg_len), i32(ext_start), i32(ext_len), i32(slots), ext if ext.numel() else torch.zeros(1, dtype=torch.int32)
        )

    def to(self, device: torch.device) -> "RowLayout":
        return RowLayout(
            *(t.to(device, non_blocking=True) for t in (self.row_q, self.seg_start, self.seg_len, self.ext_start, self.ext_len, self.slots, self.ext_slots))
        )

    def keys(self, r: int) -> torch.Tensor:
        """Row ``r``'s key slots in cache order (host; tests and the reference)."""
        a, n = int(self.seg_start[r]), int(self.seg_len[r])
        e, m = int(self.ext_start[r]), int(self.ext_len[r])
        return torch.cat([self.slots[a : a + n], self.ext_slots[e : e + m]]).long()


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, layout: RowLayout) -> torch.Tensor:
    """float64 attention of every layout row over its keys (rows no layout row names stay 0)."""
    T, H, D = q.shape
    group = H // k_cache.shape[1]
    lay = layout.to(torch.device("cpu"))
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for r in range(lay.rows):
        keys = lay.keys(r).to(k_cache.device)
        k = k_cache[keys].double().repeat_interleave(group, dim=1).cpu()  # [n, H, D]
        v = v_cache[keys].double().repeat_interleave(group, dim=1).cpu()
        t = int(lay.row_q[r])
        s = torch.einsum("hd,nhd->hn", q[t].double().cpu(), k) * scale
        out[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out
