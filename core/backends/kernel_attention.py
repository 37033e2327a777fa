"""Attention of one-row queries on specfw's compiled CPU kernel (``kernels/cpu_ops.cpp``).

Built once per forward from the host slot lists: every sequence that is not a prompt prefill is
one group -- a shared prefix of KV slots (what all its new tokens see) and, per new token, its
own extra slots (its visible tree nodes or causal predecessors, itself last). The kernel reads
K/V in place from the pool through those slot lists (no gather, no upcast copy), reads each
prefix entry once for all the group's rows, and reduces every (row, head) in one fixed order
over the row's keys in cache order: a tree node's output has the bits of the plain decode step
that produces the same token, and plain rows never depend on the batch. Prompt prefills (no
prefix, causal) are one group too where the prefix cache is on (``prefills_in_kernel``): a prompt
row then gets the bits it gets after a cache hit, where its prefix is a group's shared slots.
Else they keep one causal SDPA call per sequence, the same in plain and speculative runs (7-8%
faster at 1,500 tokens; the kernel is 10-25% faster at a few hundred, docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from ..attention import _attend_one
from ..forward_batch import SeqSpan


_NO_MASK = torch.empty(0, dtype=torch.bool)  # causal among the new tokens (a decode row: itself)


def _is_prompt_prefill(s: SeqSpan) -> bool:
    return s.q_len > 1 and s.prefix_len == 0 and s.tree_mask is None


CAUSAL_BLOCK = 32  # rows of a causal run (a prompt, an extend) per group: see _causal_blocks


def _causal_blocks(s: SeqSpan) -> list[tuple]:
    """``attention_plan``'s entries (slots, mask, q_start, q_len) for one sequence. A causal run of
    more than ``CAUSAL_BLOCK`` new rows is cut into groups of that many: a group's earlier keys are
    its shared prefix (each key read once per pass over several rows) and only the keys inside the
    block are per-row extras; as one group every earlier new row was an extra of each row (a
    1,500-token prompt read its keys ~1,500 times). A row's keys stay the same list in the same
    order, and the kernel's sums run over a row's whole list whatever part is shared, so the bits
    do not change."""
    mask = _NO_MASK if s.tree_mask is None else s.tree_mask
    if s.tree_mask is not None or s.q_len <= CAUSAL_BLOCK:
        return [(s.kv_slots, mask, s.q_start, s.q_len)]
    before = int(s.kv_slots.numel()) - s.q_len
    return [
        (s.kv_slots[: before + a + min(CAUSAL_BLOCK, s.q_len - a)], mask, s.q_start + a, min(CAUSAL_BLOCK, s.q_len - a))
        for a in range(0, s.q_len, CAUSAL_BLOCK)
    ]


class KernelAttentionPlan:
    def __init__(self, ops, seqs: list[SeqSpan], prefills_in_kernel: bool = False):
        # the slot lists in one kernel call (``cpu_ops.attention_plan``, ~10 us; numpy took ~100 us
        # a forward, and the draft loop makes several small forwards a step)
        self.ops = ops
        self.prefills = [] if prefills_in_kernel else [s for s in seqs if _is_prompt_prefill(s)]
        rest = [s for s in seqs if prefills_in_kernel or not _is_prompt_prefill(s)]
        self.rows = sum(s.q_len for s in rest)
        groups = [g for s in rest for g in _causal_blocks(s)]
        self.groups = len(groups)
        if self.groups:
            (self.prefix_ptr, self.prefix_slots, self.row_ptr, self.row_q, self.extra_ptr, self.extra_slots) = ops.attention_plan(*map(list, zip(*groups)))

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
