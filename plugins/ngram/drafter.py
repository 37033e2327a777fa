"""The ngram algorithm runtime: keeps the trie in step with every request and drafts from it.

A draft is the continuations of every suffix of the context the trie holds, longest first (BFS
breadth growing as the suffix shortens: ``min_bfs_breadth`` .. ``max_bfs_breadth``), merged into
one tree of ``num_draft_tokens - 1`` nodes, as SGLang's ngram drafts; the shorter suffixes are
the ones whose stored windows reach past the longest's end.

A node's score is its path's share of the trie's continuations (child frequencies) plus the
learned log-probability that the target's path reaches its depth in the draft
(``calibration.py``, per length of the longest matched suffix), so the draft policy's confidence
pruning can tell a likely first token from an unlikely tenth: on a CPU, where every verified row
costs time, it verifies only the part of the trie's tree that is expected to pay.
"""

from __future__ import annotations

from specfw.sdk import DraftCandidates, hookimpl

import torch

from .cache import NgramCache
from .calibration import BUCKETS, DepthCalibration, window_bucket
from .config import MatchType


class NgramDrafter:
    def __init__(self, ctx):
        self.cfg = ctx.config
        self.cache = NgramCache(self.cfg)
        self.calibration = [DepthCalibration() for _ in range(BUCKETS)]  # per window_bucket
        self.drafted: dict[str, tuple[int, list[int], list[int]]] = {}  # rid → (bucket, tokens, parents) drafted this step

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
        anchors = self.cache.match(req)  # every matched suffix, longest first: their continuations merge
        if not anchors:
            return DraftCandidates.empty()
        if self.cfg.match_type is MatchType.PROB or self.cfg.match_type == "PROB":
            tokens, parents, scores = self.trie.draft_prob([node for node, _ in anchors], budget)
        else:
            tokens, parents, scores = self.trie.draft_bfs([(node, self._breadth(w)) for node, w in anchors], budget)
        bucket = window_bucket(anchors[0][1])
        self.drafted[req.rid] = (bucket, tokens, parents)
        depth = []  # parents come before their children in both orders
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        reach = self.calibration[bucket].log_probs(max(depth, default=-1) + 1)
        scores = [s + reach[d] for s, d in zip(scores, depth)]
        return DraftCandidates(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), torch.tensor(scores, dtype=torch.float32))

    @hookimpl
    def specfw_draft(self, ctx, reqs):
        # the whole budget: the draft policy keeps the best by path probability for this step
        return [self._draft_one(r, ctx.shape.num_draft_tokens - 1) for r in reqs]

    @hookimpl
    def specfw_on_accept(self, ctx, reqs, results, hidden, aux_hidden):
        for r, res in zip(reqs, results):
            bucket, tokens, parents = self.drafted.pop(r.rid, (0, None, None))
            if tokens:
                self.calibration[bucket].observe_tree(tokens, parents, list(res.tokens))

    @hookimpl
    def specfw_release(self, ctx, req):
        self.cache.release(req)
        self.drafted.pop(req.rid, None)

    @hookimpl
    def specfw_flush_cache(self, ctx):
        self.cache.clear()  # the depth calibration stays: acceptance rates, not tokens
