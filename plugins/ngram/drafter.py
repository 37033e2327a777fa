"""The ngram algorithm runtime: keeps the trie in step with every request and drafts from it."""

from __future__ import annotations

from specfw.sdk import DraftCandidates, hookimpl

import torch

from .config import MatchType
from .trie import NgramTrie


class NgramDrafter:
    def __init__(self, ctx):
        cfg = ctx.config
        self.cfg = cfg
        self.trie = NgramTrie(cfg.branch_length, cfg.capacity)
        self.open: dict[str, tuple[int, list]] = {}  # rid → (tokens inserted, open trie paths)

    def _sync(self, req) -> None:
        """Insert the request's tokens not yet in the trie (prompt at first, then outputs)."""
        done, paths = self.open.get(req.rid, (0, []))
        seq = req.seq_ids
        if done < len(seq):
            paths = self.trie.extend(paths, seq[done:])
            self.open[req.rid] = (len(seq), paths)

    def _breadth(self, window: int) -> int:
        c = self.cfg
        if c.max_match_window_size == c.min_match_window_size:
            return c.max_bfs_breadth
        frac = (window - c.min_match_window_size) / (c.max_match_window_size - c.min_match_window_size)
        return max(c.min_bfs_breadth, round(c.max_bfs_breadth - frac * (c.max_bfs_breadth - c.min_bfs_breadth)))

    def _draft_one(self, req, budget: int) -> DraftCandidates:
        self._sync(req)
        node, window = self.trie.match(req.seq_ids, self.cfg.min_match_window_size, self.cfg.max_match_window_size)
        if node is None:
            return DraftCandidates.empty()
        if self.cfg.match_type is MatchType.PROB or self.cfg.match_type == "PROB":
            tokens, parents, scores = self.trie.draft_prob(node, budget)
        else:
            tokens, parents, scores = self.trie.draft_bfs(node, budget, self._breadth(window))
        return DraftCandidates(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), torch.tensor(scores, dtype=torch.float32))

    @hookimpl
    def specfw_draft(self, ctx, reqs):
        # the whole budget: the draft policy keeps the best by path probability for this step
        return [self._draft_one(r, ctx.shape.num_draft_tokens - 1) for r in reqs]

    @hookimpl
    def specfw_release(self, ctx, req):
        self.open.pop(req.rid, None)
