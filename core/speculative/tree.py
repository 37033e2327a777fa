"""Default tree building: rerank candidates, keep an ancestor-closed set, derive tree tensors."""

from __future__ import annotations

import torch

from .types import DraftCandidates, DraftTree


def select_candidates(cands: DraftCandidates, budget: int) -> list[int]:
    """Best ``budget`` candidates by score, closed under ancestors, in original (parents-first) order."""
    if len(cands) <= budget:
        return list(range(len(cands)))
    parents = cands.parents.tolist()
    chosen: set[int] = set()
    for i in torch.argsort(cands.scores, descending=True, stable=True).tolist():
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
    them already, so this keeps them all)."""
    keep = select_candidates(cands, size - 1)
    remap = {old: new + 1 for new, old in enumerate(keep)}
    old_parents = cands.parents.tolist()
    parents = [-1] + [remap[old_parents[i]] if old_parents[i] >= 0 else 0 for i in keep]
    tokens = torch.tensor([root_token] + cands.tokens[keep].tolist(), dtype=torch.long)
    n = len(parents)
    depth = [0] * n
    mask = torch.eye(n, dtype=torch.bool)
    next_token, next_sibling, last_child = [-1] * n, [-1] * n, [-1] * n
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        mask[i] |= mask[p]
        if last_child[p] < 0:
            next_token[p] = i
        else:
            next_sibling[last_child[p]] = i
        last_child[p] = i
    probs = cands.draft_probs[keep] if cands.draft_probs is not None and keep else None
    return DraftTree(tokens, torch.tensor(parents), torch.tensor(depth), mask, torch.tensor(next_token), torch.tensor(next_sibling), probs)
