"""Merging a draft assist's candidates into the drafter's (``speculative.draft_assist``).

Both are trees under the same root. A path the drafter already proposed is not proposed twice:
an assist node whose parent and token match an existing node becomes that node, which keeps the
higher of the two scores (two sources agreeing make the path no less likely). Every other assist
node is appended after the drafter's, so the result stays parents-first. The draft policy then
cuts the merged tree to the step's size by score, as it cuts any drafter's.
"""

from __future__ import annotations

import torch

from .types import DraftCandidates


def merge_candidates(base: DraftCandidates, extra: DraftCandidates) -> DraftCandidates:
    """``base`` plus the nodes of ``extra`` not already in it (see the module docstring).

    ``draft_probs`` survive only when ``extra`` adds no node (a new node has no draft
    distribution, and verification uses them only for a chain that carries them all)."""
    if not len(extra):
        return base
    if not len(base):
        return DraftCandidates(extra.tokens.clone(), extra.parents.clone(), extra.scores.float().clone())
    tokens, parents, scores = base.tokens.tolist(), base.parents.tolist(), base.scores.float().tolist()
    node_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    mapped: list[int] = []  # extra index -> merged index
    for t, p, s in zip(extra.tokens.tolist(), extra.parents.tolist(), extra.scores.float().tolist()):
        parent = mapped[p] if p >= 0 else -1
        i = node_of.get((parent, t))
        if i is None:
            i = len(tokens)
            tokens.append(t)
            parents.append(parent)
            scores.append(s)
            node_of[(parent, t)] = i
        else:
            scores[i] = max(scores[i], s)
        mapped.append(i)
    added = len(tokens) > len(base)
    return DraftCandidates(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor(scores, dtype=torch.float32),
        None if added else base.draft_probs,
    )
