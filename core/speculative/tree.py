"""Default tree building: rerank candidates, keep an ancestor-closed set, derive tree tensors."""

from __future__ import annotations

import numpy as np
import torch

from .types import DraftCandidates, DraftTree


def select_candidates(cands: DraftCandidates, budget: int, scores: list[float] | None = None, parents: list[int] | None = None) -> list[int]:
    """Best ``budget`` candidates by score, closed under ancestors, in original (parents-first)
    order; among equal scores the earlier candidate first. ``scores`` / ``parents``: the
    candidates' as lists, where the caller has them already. On Python lists, not torch ops: a
    step calls this right after the target's forward, when torch's per-op dispatch runs cold
    (a 36-candidate ``DraftCandidates.best`` took ~150 us there against ~30 us in a hot loop;
    session 66)."""
    if len(cands) <= budget:
        return list(range(len(cands)))
    parents = cands.parents.tolist() if parents is None else parents
    scores = cands.scores.tolist() if scores is None else scores
    chosen: set[int] = set()
    for i in sorted(range(len(scores)), key=scores.__getitem__, reverse=True):  # stable: ties keep index order
        if len(chosen) >= budget:
            break
        path, p = [], i
        while p >= 0 and p not in chosen:
            path.append(p)
            p = parents[p]
        if len(chosen) + len(path) <= budget:
            chosen.update(path)
    return sorted(chosen)


def build_tree(root_token: int, cands: DraftCandidates, size: int) -> DraftTree:
    """The tree of the root and ``cands`` (at most ``size - 1`` of them: the draft policy cut
    them already, so this keeps them all). Built in numpy and handed over as tensors (no copy):
    a step builds one per request, and torch's per-op cost made that 40-70 us a tree."""
    keep = select_candidates(cands, size - 1)
    remap = {old: new + 1 for new, old in enumerate(keep)}
    old_parents, old_tokens = cands.parents.tolist(), cands.tokens.tolist()
    parents = [-1] + [remap[old_parents[i]] if old_parents[i] >= 0 else 0 for i in keep]
    n = len(parents)
    depth = np.zeros(n, dtype=np.int64)
    mask = np.eye(n, dtype=bool)
    next_token, next_sibling, last_child = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64), [-1] * n
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        mask[i, :i] |= mask[p, :i]
        if last_child[p] < 0:
            next_token[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    tokens = torch.tensor([root_token] + [old_tokens[i] for i in keep], dtype=torch.long)
    probs = cands.draft_probs[keep] if cands.draft_probs is not None and keep else None
    return DraftTree(
        tokens,
        torch.tensor(parents, dtype=torch.long),
        torch.from_numpy(depth),
        torch.from_numpy(mask),
        torch.from_numpy(next_token),
        torch.from_numpy(next_sibling),
        probs,
    )
