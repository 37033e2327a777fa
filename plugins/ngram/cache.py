"""The n-gram cache of one engine: the shared trie plus each request's open paths, kept in step
with the requests' tokens (used by the ngram drafter and the ngram draft assist)."""

from __future__ import annotations

from .trie import NgramTrie


class NgramCache:
    def __init__(self, cfg):
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

    def match(self, req) -> list[tuple[int, int]]:
        """Every suffix of the request's context with continuations, longest first, after
        inserting the request's new tokens: [(trie node, suffix length)] (``NgramTrie.match``)."""
        self._sync(req)
        return self.trie.match(req.seq_ids, self.cfg.min_match_window_size, self.cfg.max_match_window_size)

    def release(self, req) -> None:
        self.open.pop(req.rid, None)

    def clear(self) -> None:
        """Forget every token seen (``specfw_flush_cache``): an empty trie, no open paths."""
        self.trie = NgramTrie(self.cfg.branch_length, self.cfg.capacity)
        self.open.clear()
