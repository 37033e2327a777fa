"""The prefix cache (SGLang's radix cache): finished requests' KV kept by token sequence, so a
later request that starts with the same tokens reuses those slots instead of recomputing them.

A radix tree over token ids: each edge holds a run of tokens and the KV slots of those tokens
(the slots a request wrote for them, given to the tree when it finished). ``match`` finds the
longest cached prefix of a request's tokens and ``lock`` pins that path while the request runs
(a locked node is never evicted); ``insert`` hands a finished request's slots to the tree and
says how many leading tokens the tree held already (those slots of the request are duplicates
for the caller to free). ``evict`` removes least-recently-used unlocked leaves and returns their
slots for the caller to free: the tree never touches the allocator, the scheduler does
(``core/scheduler.py``, the one owner of the KV tables).

A hit is exact where the attention gives a prompt's rows the same bits whether its prefix was
computed in the same forward or came from the cache (specfw's CPU kernels with
``engine.batch_invariant``: ``backends/kernel_attention.py``); a position's KV depends only on
the tokens up to it, so reusing it changes no later token there.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch


class _Node:
    __slots__ = ("children", "parent", "key", "slots", "lock", "last_use")

    def __init__(self, parent: "_Node | None", key: list[int], slots: torch.Tensor, tick: int):
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key  # the edge's tokens (the root's: none)
        self.slots = slots  # their KV slots, one per token
        self.lock = 0  # running requests whose matched prefix ends at or below this node
        self.last_use = tick


@dataclass
class PrefixMatch:
    """The cached prefix of a token sequence: its KV ``slots`` (one per matched token) and the
    node it ends at (``lock`` / ``unlock`` take it)."""

    slots: torch.Tensor
    node: _Node

    @property
    def length(self) -> int:
        return int(self.slots.numel())


def _common(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    for i in range(n):
        if a[i] != b[start + i]:
            return i
    return n


class PrefixCache:
    def __init__(self):
        self._tick = itertools.count(1)
        self.root = _Node(None, [], torch.empty(0, dtype=torch.long), 0)
        self.root.lock = 1  # never evicted
        self.size = 0  # cached tokens (= slots held by the tree)
        self.evictable = 0  # of them, in unlocked nodes

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` (an edge matched part way is split there)."""
        node, i, parts = self.root, 0, []
        tick = next(self._tick)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_use = tick
            parts.append(child.slots)
            node, i = child, i + k
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        return PrefixMatch(slots, node)

    def lock(self, node: _Node) -> None:
        """Pin ``node`` and its ancestors (a running request reads their KV)."""
        while node is not None:
            if node.lock == 0:
                self.evictable -= len(node.key)
            node.lock += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not None:
            node.lock -= 1
            if node.lock == 0:
                self.evictable += len(node.key)
            node = node.parent

    # ---- growth -------------------------------------------------------------------------
    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Cache ``slots`` (one per token) for ``tokens``. Returns how many leading tokens the tree
        held already: the caller's ``slots[:n]`` are the tree's own where they came from a match,
        else duplicates to free; the rest now belong to the tree."""
        if len(tokens) != int(slots.numel()):
            raise ValueError(f"{len(tokens)} tokens but {int(slots.numel())} slots")
        node, i = self.root, 0
        tick = next(self._tick)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(node, list(tokens[i:]), slots[i:].clone(), tick)
                node.children[tokens[i]] = leaf
                self.size += len(leaf.key)
                self.evictable += len(leaf.key)
                return i
            k = _common(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_use = tick
            node, i = child, i + k
        return i

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` tokens: a new node holds the first ``k`` (same lock
        count: whoever locked ``child`` locked its whole path)."""
        parent = child.parent
        head = _Node(parent, child.key[:k], child.slots[:k], child.last_use)
        head.lock = child.lock
        parent.children[child.key[0]] = head
        child.key, child.slots, child.parent = child.key[k:], child.slots[k:], head
        head.children[child.key[0]] = child
        return head

    # ---- shrinking ----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove least-recently-used unlocked leaves until at least ``num_tokens`` slots came
        free (or nothing evictable is left); returns those slots for the caller to free."""
        heap = [(n.last_use, id(n), n) for n in self._leaves() if n.lock == 0]
        heapq.heapify(heap)
        freed, count = [], 0
        while heap and count < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed.append(leaf.slots)
            count += len(leaf.key)
            self.size -= len(leaf.key)
            self.evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.long)

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                yield n

    def reset(self) -> torch.Tensor:
        """Empty the tree (no node may be locked); returns every slot it held."""
        if self.evictable != self.size:
            raise RuntimeError(f"prefix cache reset with {self.size - self.evictable} tokens locked by running requests")
        return self.evict(self.size)
