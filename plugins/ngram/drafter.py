"""The ngram algorithm runtime: keeps the trie in step with every request and drafts from it."""

from __future__ import annotations

from specfw.sdk import DraftCandidates, hookimpl

import torch

from .cache import NgramCache
from .config import MatchType


class NgramDrafter:
    def __init__(self, ctx):
        self.cfg = ctx.config
        self.cache = NgramCache(self.cfg)

    @property
    def trie(self):
        return self.cache.trie

    def _breadth(self, window: int) -> int:
        c = self.cfg
        if c.max_match_window_size == c.min_match_window_size:
            return c.max_bfs_breadth
        frac = (window - c.min_match_window_size) / (c.max_match_window_size - c.min_match_window_size)
        return max(c.min_bfs_breadth, round(c.max_bfs_breadth - frac * (c.max_bfs_breadth - c.min_bfs_breadth)))

    def _draft_one(self, req, budget: int) -> DraftCandidates:
        node, window = self.cache.match(req)
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
        self.cache.release(req)

    @hookimpl
    def specfw_flush_cache(self, ctx):
        self.cache.clear()
