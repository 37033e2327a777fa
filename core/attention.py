"""Attention over the KV pool for a ragged batch (prefill, decode and tree verification).

``plan_attention`` runs once per forward: sequences with the same (small) query length are
grouped into one SDPA call over a padded KV gather with a bool mask; others run one SDPA call
each. Prefix tokens are always visible; new tokens see each other through
``SeqSpan.tree_mask`` (causal when None). ``attend`` runs the plan for one layer.

Batch-invariant plans (``plan_attention(..., batch_invariant=True)``, the engine default):
every decode, verify or short-extend row attends as a one-row query over exactly the keys it
may see, in cache order (prefix, then its visible new tokens), with no padding and no mask.
Rows with the same number of visible keys share one SDPA call (batch dimension; each
(row, head) is computed on its own) where that is measured to keep lone-row bits on this
machine (``group_rows``, from ``invariance.grouped_attention_is_invariant``), else every row
gets its own call. A tree node's attention then rounds exactly like the
plain decode step that would produce the same token: masked-out keys and padding change
the reduction order of the softmax sums otherwise, and bf16 turns those last-bit fp32
differences into different tokens. Prompt prefill (no prefix, causal) keeps the one-call
causal path.

One-row bf16 queries run SDPA in float32 where that is measured faster on this CPU
(``_upcast_one_row_queries``; 2-4.6x on EPYCs without AMX).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .forward_batch import SeqSpan

MAX_GROUPED_Q = 16


@dataclass
class Group:
    rows: torch.Tensor  # [B*q] query rows in the flattened batch
    kv_index: torch.Tensor  # [B, kv_len] slots (padding points at slot 0 and is masked out)
    mask: torch.Tensor | None  # [B, 1, q, kv_len] bool; None when every row sees all kv_len entries
    q_len: int


def _new_token_mask(span: SeqSpan, device) -> torch.Tensor:
    if span.tree_mask is not None:
        return span.tree_mask.to(device)
    return torch.ones(span.q_len, span.q_len, dtype=torch.bool, device=device).tril_()


def _mask_for(span: SeqSpan, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] visibility of one sequence (kv_len >= its own KV length: padding is hidden).
    The tree mask covers the last ``tree_mask.shape[1]`` KV entries; earlier ones are visible."""
    tm = _new_token_mask(span, device)
    n = int(span.kv_slots.numel())
    m = torch.zeros(span.q_len, kv_len, dtype=torch.bool, device=device)
    m[:, : n - tm.shape[1]] = True
    m[:, n - tm.shape[1] : n] = tm
    return m


def plan_attention(seqs: list[SeqSpan], device, batch_invariant: bool = False, group_rows: bool = True) -> list[SeqSpan | Group]:
    if batch_invariant:
        return _plan_per_row(seqs, device, group_rows)
    by_len: dict[int, list[SeqSpan]] = {}
    for s in seqs:
        by_len.setdefault(s.q_len, []).append(s)
    plan: list[SeqSpan | Group] = []
    for q_len, group in by_len.items():
        if len(group) == 1 or q_len > MAX_GROUPED_Q:
            plan.extend(group)
            continue
        kv_len = max(int(s.kv_slots.numel()) for s in group)
        idx = torch.zeros(len(group), kv_len, dtype=torch.long, device=device)
        mask = torch.zeros(len(group), 1, q_len, kv_len, dtype=torch.bool, device=device)
        rows = []
        for i, s in enumerate(group):
            idx[i, : s.kv_slots.numel()] = s.kv_slots
            mask[i, 0] = _mask_for(s, kv_len, device)
            rows.append(torch.arange(s.q_start, s.q_start + q_len))
        plan.append(Group(torch.cat(rows).to(device), idx, mask, q_len))
    return plan


def _visible_slots(span: SeqSpan) -> list[torch.Tensor]:
    """Per new token of ``span``: the KV slots it may attend to, in cache order (host tensors)."""
    tm = _new_token_mask(span, span.kv_slots.device)
    n, m = int(span.kv_slots.numel()), tm.shape[1]
    prefix, tail = span.kv_slots[: n - m], span.kv_slots[n - m :]
    return [torch.cat([prefix, tail[tm[i]]]) for i in range(span.q_len)]


def _plan_per_row(seqs: list[SeqSpan], device, group_rows: bool) -> list[SeqSpan | Group]:
    plan: list[SeqSpan | Group] = []
    by_len: dict[int, list[tuple[int, torch.Tensor | SeqSpan]]] = {}
    for s in seqs:
        if s.q_len > 1 and s.prefix_len == 0 and s.tree_mask is None:
            plan.append(s)  # prompt prefill: one causal call
            continue
        if s.q_len == 1:
            by_len.setdefault(int(s.kv_slots.numel()), []).append((s.q_start, s))
            continue
        for i, slots in enumerate(_visible_slots(s)):
            by_len.setdefault(int(slots.numel()), []).append((s.q_start + i, slots))
    for items in by_len.values():
        if len(items) == 1 or not group_rows:  # lone rows: a view of the cache when their slots are one run
            plan.extend(sl if isinstance(sl, SeqSpan) else SeqSpan(q_start=row, q_len=1, kv_slots=sl) for row, sl in items)
            continue
        items = [(r, sl.kv_slots if isinstance(sl, SeqSpan) else sl) for r, sl in items]
        rows = torch.tensor([r for r, _ in items], dtype=torch.long, device=device)
        plan.append(Group(rows, torch.stack([sl for _, sl in items]).to(device), None, 1))
    return plan


def _sdpa(q, k, v, mask, scale, is_causal=False):
    # q [B, H, q, D]; k, v [B, Hkv, kv, D]; grouped-query heads handled by SDPA itself
    if q.shape[2] == 1 and _upcast_one_row_queries(q.dtype, q.shape[1], k.shape[1], q.shape[3], q.device):
        o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return o.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=k.shape[1] != q.shape[1])


_upcast: dict[tuple, bool] = {}


def _upcast_one_row_queries(dtype, heads: int, kv_heads: int, head_dim: int, device) -> bool:
    """Whether one-row bf16/fp16 queries (decode and tree rows) run SDPA in float32: where that is
    measured faster, once per process and shape (on the EPYCs without AMX it is, by 2-4x:
    docs/benchmarks.md, design figures). The choice holds for every one-row call of
    the process, so plain and speculative decoding round alike."""
    if dtype == torch.float32 or device.type != "cpu":
        return False
    key = (dtype, heads, kv_heads, head_dim, torch.get_num_threads())
    if key not in _upcast:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(4, heads, 1, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(4, kv_heads, 300, head_dim, generator=g).to(dtype) for _ in range(2))
        gqa = kv_heads != heads
        native = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)  # noqa: E731
        upcast = lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=gqa).to(dtype)  # noqa: E731
        seconds: dict = {native: [], upcast: []}
        with torch.inference_mode():
            for rep in range(12):
                for f in seconds:
                    t = time.perf_counter()
                    f()
                    if rep >= 2:  # first calls allocate and initialise
                        seconds[f].append(time.perf_counter() - t)
        _upcast[key] = sorted(seconds[upcast])[5] < sorted(seconds[native])[5]  # medians
    return _upcast[key]


def _gather(cache: torch.Tensor, s: SeqSpan) -> torch.Tensor:
    """A sequence's K or V as [1, Hkv, kv, D]; a view when its slots are one ascending run."""
    if s.kv_range is not None:
        return cache[s.kv_range[0] : s.kv_range[1]].transpose(0, 1).unsqueeze(0)
    return cache.index_select(0, s.slots_on(cache.device)).transpose(0, 1).unsqueeze(0)


def _attend_one(q, k_cache, v_cache, s: SeqSpan, scale) -> torch.Tensor:
    qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    k, v = _gather(k_cache, s), _gather(v_cache, s)  # [1, Hkv, kv, D]
    if s.q_len == 1:
        o = _sdpa(qs, k, v, None, scale)
    elif s.tree_mask is None and s.prefix_len == 0:
        o = _sdpa(qs, k, v, None, scale, is_causal=True)
    else:
        o = _sdpa(qs, k, v, _span_mask(s, q.device), scale)
    return o[0].transpose(0, 1)


def _span_mask(s: SeqSpan, device) -> torch.Tensor:
    """``s``'s [1, 1, q_len, kv_len] visibility, built once per forward and shared by every layer."""
    m = getattr(s, "_mask", None)
    if m is None or m.device != device:
        m = _mask_for(s, s.kv_slots.numel(), device)[None, None]
        s._mask = m
    return m


def _attend_group(q, k_cache, v_cache, g: Group, scale) -> torch.Tensor:
    B = g.kv_index.shape[0]
    qs = q.index_select(0, g.rows).view(B, g.q_len, *q.shape[1:]).transpose(1, 2)  # [B, H, q, D]
    flat = g.kv_index.view(-1)
    k = k_cache.index_select(0, flat).view(B, -1, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, kv, D]
    v = v_cache.index_select(0, flat).view(B, -1, *v_cache.shape[1:]).transpose(1, 2)
    o = _sdpa(qs, k, v, g.mask, scale)  # [B, H, q, D]
    return o.transpose(1, 2).reshape(-1, *q.shape[1:])


def _rows(item) -> int:
    return int(item.rows.numel()) if isinstance(item, Group) else item.q_len


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[SeqSpan | Group], scale: float) -> torch.Tensor:
    """q: [T, H, D] (new tokens, rope applied); caches [slots, Hkv, D] already hold the new K/V.
    Returns [T, H, D]."""
    if len(plan) == 1 and isinstance(plan[0], SeqSpan) and plan[0].q_len == q.shape[0]:
        return _attend_one(q, k_cache, v_cache, plan[0], scale)
    out = torch.zeros_like(q) if sum(_rows(p) for p in plan) != q.shape[0] else torch.empty_like(q)
    for item in plan:
        if isinstance(item, Group):
            out[item.rows] = _attend_group(q, k_cache, v_cache, item, scale)
        else:
            out[item.q_start : item.q_start + item.q_len] = _attend_one(q, k_cache, v_cache, item, scale)
    return out
