"""EAGLE-2 style tree drafting shared by model-based drafters (standalone, eagle, eagle3).

Given the first draft logits per request (from the drafter's extend pass over the committed
sequence, ending at the root), ``beam_search`` expands ``topk`` beams for ``num_steps``:

  * each beam gets ``topk`` children scored by cumulative log-probability; every child becomes
    a candidate (they all compete in the tree builder's rerank);
  * the best ``topk`` children are the next beams; they are forwarded through the drafter in one
    batched call, each attending to the committed prefix, its drafted ancestors and itself.

The drafter supplies ``step(chunks, parent_hidden)``: one forward over beam nodes, returning
``(logits, hidden)`` (hidden may be None for drafters that do not chain features). Draft KV
slots of beam nodes are allocated here and freed before returning: only the committed prefix
stays in the drafter's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..backends.base import torch_top_logprobs
from ..sampling import target_probs
from .types import DraftCandidates


@dataclass
class _Cands:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    probs: list = field(default_factory=list)

    def to_candidates(self) -> DraftCandidates:
        probs = torch.stack(self.probs) if self.probs and all(p is not None for p in self.probs) else None
        return DraftCandidates(
            torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.parents, dtype=torch.long), torch.tensor(self.scores, dtype=torch.float32), probs
        )


def _top_rows(logits: torch.Tensor, k: int, top_logprobs: Callable | None = None) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's ``k`` best log-probabilities and their ids, read back in one copy (one device
    sync for every row of every request: ids < 2^24 are exact in float32). ``top_logprobs``: a
    backend's ``Backend.top_logprobs`` (default: torch's ops)."""
    vs, ids = (top_logprobs or torch_top_logprobs)(logits, k).tolist()
    return vs, [[int(i) for i in row] for row in ids]


def _expand(
    req,
    logits: torch.Tensor,
    beams: list[tuple[int, float, int]],
    k: int,
    cands: _Cands,
    sampled: bool,
    to_target: torch.Tensor | None,
    vocab_size: int | None,
    top: tuple[list[list[float]], list[list[int]]] | None,
) -> list[tuple[int, float, int]]:
    """beams: (candidate index, score, row in ``logits``). Returns the best ``k`` children as
    next beams: (candidate index, score, row of ``logits`` that produced them). A greedy draft
    takes its children from ``top`` (``_top_rows`` of ``logits``, read back once for the whole
    batch); a sampled one samples on the host and, over a token map, keeps its distribution over
    the whole vocabulary (``vocab_size``; zero off the map) for rejection sampling."""
    children = []
    if sampled:
        for parent, score, row in beams:  # on the host, where the request's generator is
            probs = target_probs(logits[row : row + 1].cpu(), req.params)[0]
            tok = int(torch.multinomial(probs, 1, generator=req.generator))
            full = probs if to_target is None else (probs.new_zeros(vocab_size).index_copy_(0, to_target, probs) if vocab_size else None)
            children.append((score + float(torch.log(probs[tok] + 1e-20)), parent, tok, full, row))
    else:
        for parent, score, row in beams:
            children.extend((score + a, parent, b, None, row) for a, b in zip(top[0][row], top[1][row]))
    children.sort(key=lambda c: -c[0])
    toks = [c[2] for c in children]
    if to_target is not None and toks:
        host = _host_list(to_target)
        toks = [host[t] for t in toks]
    nxt = []
    for j, ((score, parent, _, probs, row), tok) in enumerate(zip(children, toks)):
        cands.tokens.append(tok)
        cands.parents.append(parent)
        cands.scores.append(score)
        cands.probs.append(probs)
        if j < k:
            nxt.append((len(cands.tokens) - 1, score, row))
    return nxt


def _host_list(t: torch.Tensor) -> list[int]:
    """A token map as a host list, kept on the map tensor itself (made once, gone with it): read
    per drafted token, list indexing instead of three tensor ops an expansion."""
    host = getattr(t, "_specfw_host_list", None)
    if host is None:
        host = t._specfw_host_list = t.tolist()
    return host


def _kth_best(scores: list[float], k: int | None) -> float:
    """The k-th highest score (-inf while there are fewer than k, or without a k)."""
    if not k or len(scores) < k:
        return float("-inf")
    return sorted(scores, reverse=True)[k - 1]


def beam_search(
    reqs,
    first_logits: torch.Tensor,
    first_hidden: torch.Tensor | None,
    topk: int,
    num_steps: int,
    committed_slots: Callable,
    allocator,
    step: Callable,
    sampled: Callable = lambda r: False,
    to_target: torch.Tensor | None = None,
    root_position: Callable = lambda r: r.seq_len - 1,
    score_floor: float = float("-inf"),
    keep: int | None = None,
    vocab_size: int | None = None,
    top_logprobs: Callable | None = None,
) -> list[DraftCandidates]:
    """``first_logits[i]``/``first_hidden[i]``: the drafter's output at request i's root.
    ``committed_slots(req)`` → its draft KV slots (prefix incl. root). ``to_target`` maps a
    reduced draft vocabulary to target ids (FR-Spec / EAGLE-3 ``d2t``; ``vocab_size``: the
    target's, to give sampled drafts full-vocabulary probabilities). Beams scoring below
    ``score_floor`` are not expanded (their children would score no higher and be pruned);
    drafting stops early when no beam is left. ``keep``: how many candidates the step verifies at
    most (``plan.size - 1``, the best by score); a beam scoring below a request's ``keep``-th best
    candidate so far is not expanded either: its children score no higher than it, so none of
    them could be among the kept (the cut is the same; the head forwards are fewer).
    ``top_logprobs``: the backend's per-row top-k of log-softmax (``Backend.top_logprobs``)."""
    cands = [_Cands() for _ in reqs]
    any_greedy = not all(sampled(r) for r in reqs)  # then every row's top k comes back in one copy per depth

    def rows_of(top, start: int, n: int):
        return None if top is None else (top[0][start : start + n], top[1][start : start + n])

    top = _top_rows(first_logits, topk, top_logprobs) if any_greedy else None
    beams = [
        _expand(r, first_logits[i : i + 1], [(-1, 0.0, 0)], topk, cands[i], sampled(r), to_target, vocab_size, rows_of(top, i, 1)) for i, r in enumerate(reqs)
    ]
    hidden = first_hidden
    row_base = list(range(len(reqs)))  # request i's first row in ``hidden`` (the last step's output)
    drafted = [[] for _ in reqs]  # per request: draft slots of forwarded beam nodes, in order
    rows_to = [dict() for _ in reqs]  # candidate index → positions in drafted[i] of it and its forwarded ancestors
    try:
        for depth in range(1, num_steps):
            floors = [max(score_floor, _kth_best(c.scores, keep)) for c in cands]  # once per request and depth
            beams = [[b for b in bs if b[1] >= floor] for bs, floor in zip(beams, floors)]
            live = [i for i, bs in enumerate(beams) if bs]
            if not live:
                break
            chunks, parent_rows = [], []
            for i in live:
                r = reqs[i]
                bs, prev = beams[i], len(drafted[i])
                mask = []  # each beam attends to its forwarded ancestors and itself: one tensor made from host rows
                for j, (c, _, _) in enumerate(bs):
                    p = cands[i].parents[c]
                    own = rows_to[i][c] = (rows_to[i][p] if p >= 0 else []) + [prev + j]
                    row = [False] * (prev + len(bs))
                    for a in own:
                        row[a] = True
                    mask.append(row)
                mask = torch.tensor(mask, dtype=torch.bool)
                slots = allocator.alloc(len(bs))
                prefix = torch.cat([committed_slots(r), torch.tensor(drafted[i], dtype=torch.long)])
                toks = torch.tensor([cands[i].tokens[c] for c, _, _ in bs], dtype=torch.long)
                chunks.append((toks, torch.full((len(bs),), root_position(r) + depth, dtype=torch.long), slots, prefix, mask))
                drafted[i].extend(slots.tolist())
                parent_rows.extend(row_base[i] + row for _, _, row in bs)
            parent_hidden = hidden[torch.tensor(parent_rows).to(hidden.device)] if hidden is not None else None
            logits, hidden = step(chunks, parent_hidden)
            top = _top_rows(logits, topk, top_logprobs) if any_greedy else None
            off = 0
            for i in live:
                r, n = reqs[i], len(beams[i])
                beams[i] = _expand(
                    r,
                    logits[off : off + n],
                    [(c, s, j) for j, (c, s, _) in enumerate(beams[i])],
                    topk,
                    cands[i],
                    sampled(r),
                    to_target,
                    vocab_size,
                    rows_of(top, off, n),
                )
                row_base[i] = off
                off += n
    finally:
        for d in drafted:
            if d:
                allocator.free(torch.tensor(d, dtype=torch.long))
    return [c.to_candidates() for c in cands]
