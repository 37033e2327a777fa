"""An n-gram trie over recent token windows, shared by all requests, capacity-bounded (LRU).

Every position of every request's sequence starts a path of up to ``branch_length`` tokens.
Insertion is incremental: each request keeps the open paths that end at its last token and
extends them with each new token. Matching walks a suffix of the context from the root; the
node reached holds the continuations observed after that suffix.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict


class Node:
    __slots__ = ("token", "parent", "children", "count", "alive", "uid", "depth")
    _uids = itertools.count()

    def __init__(self, token: int, parent: "Node | None"):
        self.token, self.parent = token, parent
        self.depth = parent.depth + 1 if parent is not None else 0
        self.children: dict[int, Node] = {}
        self.count = 0
        self.alive = True
        self.uid = next(Node._uids)


class NgramTrie:
    def __init__(self, branch_length: int = 18, capacity: int = 10_000_000):
        self.branch_length = branch_length
        self.capacity = capacity
        self.root = Node(-1, None)
        self.lru: OrderedDict[int, Node] = OrderedDict()  # uid → node, least recently used first

    def __len__(self) -> int:
        return len(self.lru)

    # ---- insertion ------------------------------------------------------------------------
    def _child(self, node: Node, token: int) -> Node:
        c = node.children.get(token)
        if c is None:
            c = Node(token, node)
            node.children[token] = c
        c.count += 1
        self.lru[c.uid] = c
        self.lru.move_to_end(c.uid)
        return c

    def extend(self, open_paths: list[Node], tokens: list[int]) -> list[Node]:
        """Append ``tokens`` to a sequence whose open paths (nodes ending at its last token,
        shallowest path last) are ``open_paths``; returns the new open paths."""
        paths = [n for n in open_paths if n.alive]
        for t in tokens:
            paths = [self._child(n, t) for n in paths if self._depth_ok(n)]
            paths.append(self._child(self.root, t))
        self._evict()
        return [n for n in paths if n.alive]

    def _depth_ok(self, node: Node) -> bool:
        return node.depth < self.branch_length

    def _evict(self) -> None:
        while len(self.lru) > self.capacity:
            _, node = self.lru.popitem(last=False)
            if node.parent is not None and node.parent.children.get(node.token) is node:
                del node.parent.children[node.token]
            self._kill(node)

    def _kill(self, node: Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            n.alive = False
            self.lru.pop(n.uid, None)
            stack.extend(n.children.values())

    # ---- matching -------------------------------------------------------------------------
    def match(self, context: list[int], min_window: int, max_window: int) -> tuple[Node | None, int]:
        """Longest suffix of ``context`` (``min_window..max_window`` tokens) whose trie node has
        continuations; returns (node, window length) or (None, 0)."""
        for w in range(min(max_window, len(context)), min_window - 1, -1):
            node = self.root
            for t in context[-w:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, w
        return None, 0

    @staticmethod
    def _recent_first(node: Node) -> list[Node]:
        return sorted(node.children.values(), key=lambda c: c.uid, reverse=True)

    def draft_bfs(self, start: Node, budget: int, breadth: int) -> tuple[list[int], list[int], list[float]]:
        """Breadth-first over continuations, at most ``breadth`` most recent children per node.
        Scores are log path probabilities (normalised child frequencies), so a smaller budget
        can keep the likeliest part of the tree."""
        tokens, parents, scores = [], [], []
        frontier = [(start, -1, 0.0)]
        while frontier and len(tokens) < budget:
            nxt = []
            for node, idx, logp in frontier:
                total = sum(c.count for c in node.children.values())
                for c in self._recent_first(node)[:breadth]:
                    if len(tokens) >= budget:
                        break
                    tokens.append(c.token)
                    parents.append(idx)
                    scores.append(logp + math.log(c.count / total))
                    nxt.append((c, len(tokens) - 1, scores[-1]))
            frontier = nxt
        return tokens, parents, scores

    def draft_prob(self, start: Node, budget: int) -> tuple[list[int], list[int], list[float]]:
        """Best-first by path probability (product of normalised child frequencies)."""
        tokens, parents, scores = [], [], []
        heap: list = []
        tick = itertools.count()

        def push_children(node: Node, idx: int, logp: float):
            total = sum(c.count for c in node.children.values())
            for c in node.children.values():
                heapq.heappush(heap, (-(logp + math.log(c.count / total)), next(tick), c, idx))

        push_children(start, -1, 0.0)
        while heap and len(tokens) < budget:
            neg, _, c, idx = heapq.heappop(heap)
            tokens.append(c.token)
            parents.append(idx)
            scores.append(-neg)
            push_children(c, len(tokens) - 1, -neg)
        return tokens, parents, scores
