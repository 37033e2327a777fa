"""An n-gram trie over recent token windows, shared by all requests, capacity-bounded (LRU).

Every position of every request's sequence starts a path of up to ``branch_length`` tokens.
Insertion is incremental: each request keeps the open paths that end at its last token and
extends them with each new token. Matching walks a suffix of the context from the root; the
node reached holds the continuations observed after that suffix.

Nodes are integer ids into flat ``array.array`` columns (no Python object per node): a trie of a
million nodes made of objects with ``parent`` links is a million cycles for Python's garbage
collector, whose full passes then cost more than the insertion itself (2/3 of an insertion's
time, measured) and stall the whole process (a full pass 353 ms at 1M nodes; with lists of ints
the collector still walks every element, 179 ms; arrays it never visits, 35 ms: the rest of the
process). An edge is an entry ``(parent << 32 | token) -> child`` of one dict of ints, which the
collector does not track; a node's children are a linked list, newest first.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import deque

ROOT = 0
_LOW = (1 << 32) - 1  # the id half of an edge key, a touch record or an open-path handle
# each column's value for an unused id, the root's too: token, parent (-1: a free id), depth,
# count, last touch, generation, first child, next and previous sibling (-1: none)
_BLANK = (-1, -1, 0, 0, 0, 0, -1, -1, -1)


class NgramTrie:
    def __init__(self, branch_length: int = 18, capacity: int = 10_000_000):
        self.branch_length = branch_length
        self.capacity = capacity
        self.edges: dict[int, int] = {}  # parent << 32 | token → child id
        # per node id: its token, parent (-1: a free id; the root's is -1 too), depth, times
        # touched, last touch, children (newest first) and siblings, and a generation bumped
        # when the id is freed (an open path handle names the generation it was made in)
        self._columns = tuple(array("q", [v]) for v in _BLANK)  # one entry each: the root
        self.token, self.parent, self.depth, self.count, self.stamp, self.gen, self.first, self.next, self.prev = self._columns
        self.free: list[int] = []
        self.top = 1  # ids below it have been used
        self.size = 0  # live nodes, the root not counted
        self.tick = 0
        # touch records ``stamp << 32 | id`` in touch order, kept once the trie first reaches its
        # capacity (the least recently touched live node is then the first current record)
        self.touches: deque[int] | None = None

    def __len__(self) -> int:
        return self.size

    def alive(self, node: int) -> bool:
        return node == ROOT or self.parent[node] >= 0

    # ---- insertion ------------------------------------------------------------------------
    def _new(self, parent: int, token: int) -> int:
        if self.free:
            n = self.free.pop()
        else:
            n = self.top
            self.top += 1
            if n == len(self.token):  # double every column (a free id's parent is -1)
                for column, blank in zip(self._columns, _BLANK):
                    column.extend(array("q", [blank]) * n)
        head = self.first[parent]
        self.token[n], self.parent[n], self.depth[n], self.count[n] = token, parent, self.depth[parent] + 1, 0
        self.first[n], self.next[n], self.prev[n] = -1, head, -1
        if head >= 0:
            self.prev[head] = n
        self.first[parent] = n
        self.size += 1
        return n

    def extend(self, open_paths: list[int], tokens: list[int]) -> list[int]:
        """Append ``tokens`` to a sequence whose open paths (handles of the nodes ending at its
        last token, shallowest last) are ``open_paths``; returns the new open paths."""
        edges, count, stamp, depth, gen = self.edges, self.count, self.stamp, self.depth, self.gen
        touches, deep, tick = self.touches, self.branch_length, self.tick
        paths = [h & _LOW for h in open_paths if gen[h & _LOW] == h >> 32]
        for t in tokens:
            nxt = []
            paths = [n for n in paths if depth[n] < deep]
            paths.append(ROOT)
            for n in paths:
                key = n << 32 | t
                c = edges.get(key)
                if c is None:
                    c = edges[key] = self._new(n, t)
                count[c] += 1
                tick += 1
                stamp[c] = tick
                if touches is not None:
                    touches.append(tick << 32 | c)
                nxt.append(c)
            paths = nxt
        self.tick = tick
        handles = [n | gen[n] << 32 for n in paths]
        self._evict()
        return [h for h in handles if gen[h & _LOW] == h >> 32]

    def _evict(self) -> None:
        if self.size <= self.capacity:
            return
        if self.touches is None:  # the first time full: the live nodes in touch order
            live = sorted((n for n in range(1, self.top) if self.parent[n] >= 0), key=self.stamp.__getitem__)
            self.touches = deque(self.stamp[n] << 32 | n for n in live)
        while self.size > self.capacity:
            r = self.touches.popleft()
            n = r & _LOW
            if self.parent[n] >= 0 and self.stamp[n] == r >> 32:  # not a stale record
                self._kill(n)
        if len(self.touches) > 2 * self.size + 65_536:  # drop the stale records (order kept)
            self.touches = deque(r for r in self.touches if self.parent[r & _LOW] >= 0 and self.stamp[r & _LOW] == r >> 32)

    def _kill(self, node: int) -> None:
        """Free ``node`` and its subtree; unlink it from its parent."""
        p, nx, pv = self.parent[node], self.next[node], self.prev[node]
        if pv >= 0:
            self.next[pv] = nx
        else:
            self.first[p] = nx
        if nx >= 0:
            self.prev[nx] = pv
        stack = [node]
        while stack:
            n = stack.pop()
            c = self.first[n]
            while c >= 0:
                stack.append(c)
                c = self.next[c]
            del self.edges[self.parent[n] << 32 | self.token[n]]
            self.parent[n] = -1
            self.gen[n] += 1
            self.free.append(n)
            self.size -= 1

    # ---- matching -------------------------------------------------------------------------
    def children(self, node: int) -> list[int]:
        """``node``'s children, the most recently created first."""
        out, c = [], self.first[node]
        while c >= 0:
            out.append(c)
            c = self.next[c]
        return out

    def match(self, context: list[int], min_window: int, max_window: int) -> list[tuple[int, int]]:
        """Every suffix of ``context`` (``min_window..max_window`` tokens) whose trie node has
        continuations, longest first: [(node, window length)] (empty when none). A window of w
        tokens was inserted with at most ``branch_length - w`` tokens after it, so the shorter
        matches are the ones that reach deeper (SGLang's ngram drafts from all of them)."""
        edges, first, out = self.edges, self.first, []
        for w in range(min(max_window, len(context)), min_window - 1, -1):
            node = ROOT
            for t in context[-w:]:
                node = edges.get(node << 32 | t)
                if node is None:
                    break
            if node is not None and first[node] >= 0:
                out.append((node, w))
        return out

    def draft_bfs(self, anchors: list[tuple[int, int]], budget: int) -> tuple[list[int], list[int], list[float]]:
        """Breadth-first over the continuations of each anchor ``(node, breadth)`` in turn (at most
        ``breadth`` most recent children per node), merged into one tree of at most ``budget``
        nodes: a continuation already in the tree (the same tokens after the root) is the same
        node, so a later (shorter) anchor extends the earlier ones' paths and adds only what they
        lack. Scores are log path probabilities (normalised child frequencies, each node's taken
        at the anchor that added it, below its parent's), so a smaller budget can keep the
        likeliest part of the tree. Parents come before their children."""
        tokens, parents, scores = [], [], []
        index: dict[tuple[int, int], int] = {}  # (parent index, token) → node index in the tree
        for start, breadth in anchors:
            frontier = [(start, -1)]
            while frontier and len(tokens) < budget:
                nxt = []
                for node, idx in frontier:
                    kids = self.children(node)
                    total = sum(self.count[c] for c in kids)
                    for c in kids[:breadth]:
                        j = index.get((idx, self.token[c]))
                        if j is None:
                            if len(tokens) >= budget:
                                break
                            j = index[(idx, self.token[c])] = len(tokens)
                            tokens.append(self.token[c])
                            parents.append(idx)
                            scores.append((scores[idx] if idx >= 0 else 0.0) + math.log(self.count[c] / total))
                        nxt.append((c, j))
                frontier = nxt
            if len(tokens) >= budget:
                break
        return tokens, parents, scores

    def draft_prob(self, anchors: list[int], budget: int) -> tuple[list[int], list[int], list[float]]:
        """Best-first by path probability (product of normalised child frequencies) from each
        anchor node in turn, merged into one tree as ``draft_bfs``; among equal probabilities the
        continuation seen first."""
        tokens, parents, scores = [], [], []
        index: dict[tuple[int, int], int] = {}
        tick = itertools.count()
        for start in anchors:
            heap: list = []

            def push_children(node: int, idx: int, logp: float):
                kids = self.children(node)[::-1]
                total = sum(self.count[c] for c in kids)
                for c in kids:
                    heapq.heappush(heap, (-(logp + math.log(self.count[c] / total)), next(tick), c, idx))

            push_children(start, -1, 0.0)
            while heap and len(tokens) < budget:
                neg, _, c, idx = heapq.heappop(heap)
                j = index.get((idx, self.token[c]))
                if j is None:
                    j = index[(idx, self.token[c])] = len(tokens)
                    tokens.append(self.token[c])
                    parents.append(idx)
                    scores.append(-neg)  # the parent's score (its own, where merged) + this child's log-frequency
                push_children(c, j, scores[j])
            if len(tokens) >= budget:
                break
        return tokens, parents, scores

    def draft_chain(self, anchors: list[int], budget: int) -> list[int]:
        """One chain of at most ``budget`` tokens: the most recent continuation of the first anchor
        node, then of each later (shorter) anchor whose continuations hold the chain so far (they
        reach deeper), from where the chain ends."""
        edges, chain = self.edges, []
        for start in anchors:
            node = start
            for t in chain:  # the chain so far, along this anchor's continuations
                node = edges.get(node << 32 | t)
                if node is None:
                    break
            if node is None:
                continue
            while len(chain) < budget and self.first[node] >= 0:
                node = self.first[node]  # the most recent child
                chain.append(self.token[node])
            if len(chain) >= budget:
                break
        return chain
