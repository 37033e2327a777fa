"""Attention of one-row queries on specfw's compiled CPU kernel (``kernels/cpu_ops.cpp``).

Built once per forward from the host slot lists: every sequence that is not a prompt prefill is
one group -- a shared prefix of KV slots (what all its new tokens see) and, per new token, its
own extra slots (its visible tree nodes or causal predecessors, itself last). The kernel reads
K/V in place from the pool through those slot lists (no gather, no upcast copy), reads each
prefix entry once for all the group's rows, and reduces every (row, head) in one fixed order
over the row's keys in cache order: a tree node's output has the bits of the plain decode step
that produces the same token, and plain rows never depend on the batch. Prompt prefills (no
prefix, causal) keep one causal SDPA call per sequence, the same in plain and speculative runs.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention import _attend_one
from ..forward_batch import SeqSpan


_ONE, _ZERO = np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64)


def _is_prompt_prefill(s: SeqSpan) -> bool:
    return s.q_len > 1 and s.prefix_len == 0 and s.tree_mask is None


class KernelAttentionPlan:
    def __init__(self, ops, seqs: list[SeqSpan]):
        # the slot lists are small host arrays: numpy (~1 us an op) rather than torch (~5 us),
        # this runs once per forward, and the draft loop makes several small forwards a step
        self.ops = ops
        self.prefills = [s for s in seqs if _is_prompt_prefill(s)]
        prefix, extras, counts, row_ptr, row_q = [], [], [], [0], []
        for s in seqs:
            if _is_prompt_prefill(s):
                continue
            slots = s.kv_slots.numpy()
            n = len(slots)
            if s.q_len == 1 and s.tree_mask is None:  # a decode row: everything but itself is prefix
                prefix.append(slots[: n - 1])
                extras.append(slots[n - 1 :])
                counts.append(_ONE)
            else:
                tm = s.tree_mask.numpy() if s.tree_mask is not None else np.tri(s.q_len, dtype=bool)
                m = tm.shape[1]
                prefix.append(slots[: n - m])
                extras.append(np.broadcast_to(slots[n - m :], (s.q_len, m))[tm])  # row-major: row 0's, row 1's, ...
                counts.append(tm.sum(1))
            row_q.extend(range(s.q_start, s.q_start + s.q_len))
            row_ptr.append(len(row_q))
        self.groups = len(prefix)
        self.rows = len(row_q)
        if self.groups:
            self.prefix_ptr = torch.from_numpy(np.cumsum([0, *map(len, prefix)], dtype=np.int64))
            self.prefix_slots = torch.from_numpy(np.concatenate(prefix).astype(np.int64, copy=False))
            self.row_ptr = torch.tensor(row_ptr, dtype=torch.long)
            self.row_q = torch.tensor(row_q, dtype=torch.long)
            self.extra_ptr = torch.from_numpy(np.concatenate([_ZERO, *counts]).cumsum(dtype=np.int64))
            self.extra_slots = torch.from_numpy(np.concatenate(extras).astype(np.int64, copy=False))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        q = q.contiguous()
        covered = self.rows + sum(s.q_len for s in self.prefills)
        out = torch.empty_like(q) if covered == q.shape[0] else torch.zeros_like(q)
        if self.groups:
            self.ops.attention(
                q, k_cache, v_cache, out, float(scale), self.prefix_ptr, self.prefix_slots, self.row_ptr, self.row_q, self.extra_ptr, self.extra_slots
            )
        for s in self.prefills:
            out[s.q_start : s.q_start + s.q_len] = _attend_one(q, k_cache, v_cache, s, scale)
        return out
