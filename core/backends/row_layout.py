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

import numpy as np
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
        """Built with numpy on the host: a forward's layout is a few small arrays, and this runs
        before every forward (a graphed decode step on a GPU is ~2 ms, so per-op torch overhead
        on the host counts)."""
        R = sum(s.q_len for s in seqs)
        row_q, seg_start, seg_len, ext_start, ext_len = (np.empty(R, np.int32) for _ in range(5))
        slots, extras = [], []
        base = ebase = r = 0
        for s in seqs:
            kv = s.kv_slots.cpu().numpy()
            n, q = kv.shape[0], s.q_len
            P = n - q
            slots.append(kv)
            rows = slice(r, r + q)
            row_q[rows] = np.arange(s.q_start, s.q_start + q)
            seg_start[rows] = base
            if s.tree_mask is None:
                seg_len[rows] = np.arange(P + 1, P + q + 1)
                ext_start[rows] = ebase
                ext_len[rows] = 0
            else:
                tm = s.tree_mask.cpu().numpy()
                m = tm.shape[1]
                seg_len[rows] = n - m
                counts = tm.sum(1)
                extras.append(np.broadcast_to(kv[n - m :], (q, m))[tm])  # row-major: row 0's, row 1's, ...
                ext_start[rows] = ebase + np.cumsum(counts) - counts
                ext_len[rows] = counts
                ebase += int(counts.sum())
            base += n
            r += q
        i32 = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa: E731
        ext = i32(extras)
        parts = (row_q, seg_start, seg_len, ext_start, ext_len, i32(slots), ext if ext.size else np.zeros(1, np.int32))
        return cls(*(torch.from_numpy(a) for a in parts))

    def to(self, device: torch.device) -> "RowLayout":
        """On ``device`` in one host-to-device copy: the seven arrays are views of one buffer there,
        each starting 64-byte aligned (Triton specialises a kernel on its pointers' alignment:
        unaligned views would compile variants as offsets vary)."""
        parts = (self.row_q, self.seg_start, self.seg_len, self.ext_start, self.ext_len, self.slots, self.ext_slots)
        if torch.device(device).type == "cpu":
            return RowLayout(*(t.cpu() for t in parts))
        flat, starts = pack_aligned(parts)
        return RowLayout(*unpack(flat.to(device, non_blocking=True), starts, parts))

    def keys(self, r: int) -> torch.Tensor:
        """Row ``r``'s key slots in cache order (host; tests and the reference)."""
        a, n = int(self.seg_start[r]), int(self.seg_len[r])
        e, m = int(self.ext_start[r]), int(self.ext_len[r])
        return torch.cat([self.slots[a : a + n], self.ext_slots[e : e + m]]).long()


def aligned(n: int) -> int:
    """``n`` rounded up to 16 elements: a view of an int32 buffer at such an offset starts 64-byte
    aligned (what Triton's pointer specialisation looks at)."""
    return -(-n // 16) * 16


def pack_aligned(parts) -> tuple[torch.Tensor, list[int]]:
    """``parts`` (1-D int32 host tensors) in one host tensor, each from an ``aligned`` start:
    (the tensor, the starts)."""
    starts = np.cumsum([0] + [aligned(t.numel()) for t in parts]).tolist()
    host = np.zeros(starts[-1], np.int32)
    for a, t in zip(starts, parts):
        host[a : a + t.numel()] = t.cpu().numpy()
    return torch.from_numpy(host), starts


def unpack(flat: torch.Tensor, starts: list[int], parts) -> list[torch.Tensor]:
    """The views of ``flat`` that ``pack_aligned`` put ``parts`` at."""
    return [flat[a : a + t.numel()] for a, t in zip(starts, parts)]


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
