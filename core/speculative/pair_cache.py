"""The EAGLE-family head's KV kept across requests, as the target's prefix cache keeps the
target's (``core/prefix_cache.py``): without it a request whose target prefix came from the
cache would start drafting with no context of the head's own (its pairs would begin where the
target's prefill began), and in a chat's second turn the demo EAGLE-3 head then accepts 2.5
tokens a step instead of 3.4.

Pair i is (token t_{i+1}, target feature f_i); its head KV depends on t_0..t_{i+1}, so it is
cached under the key (t_i, t_{i+1}) at depth i of a radix tree (the same ``PrefixCache``, over
the drafter's own slot pool). To continue from its cached pairs 0..m-1 the drafter needs the
target's features from position m on, so it asks the scheduler to reuse only m tokens of the
target's cached prefix (hook ``specfw_prefix_to_reuse``): the target recomputes the few tokens
between (a finished request's last step's pairs were never extended).
"""

from __future__ import annotations

import torch

from ..kv_cache import SlotAllocator
from ..prefix_cache import PrefixCache, PrefixMatch


def pair_keys(seq_ids: list[int], n: int) -> list[tuple[int, int]]:
    return list(zip(seq_ids[:n], seq_ids[1 : n + 1]))


class PairCache:
    def __init__(self, allocator: SlotAllocator):
        self.allocator = allocator
        self.tree = PrefixCache()

    def reach(self, seq_ids: list[int], n: int) -> int:
        """How many of pairs 0..n-1 of ``seq_ids`` are cached (from pair 0 on)."""
        return self.tree.match(pair_keys(seq_ids, n)).length if n > 0 else 0

    def take(self, seq_ids: list[int], n: int) -> PrefixMatch | None:
        """The head KV of pairs 0..n-1 of ``seq_ids``, locked, if all of them are cached; else None."""
        if n <= 0:
            return None
        hit = self.tree.match(pair_keys(seq_ids, n))
        if hit.length < n:
            return None
        self.tree.lock(hit.node)
        return hit

    def give(self, seq_ids: list[int], slots: torch.Tensor, held: PrefixMatch | None) -> None:
        """A finished request's pairs 0..len(slots)-1 into the cache (those cached already are
        freed); the prefix it took (``held``, its first slots) unlocked."""
        own = held.length if held is not None else 0
        n = min(int(slots.numel()), len(seq_ids) - 1)
        if n > own:
            self.allocator.free(slots[own : self.tree.insert(pair_keys(seq_ids, n), slots[:n])])
        self.allocator.free(slots[max(n, own) :])
        if held is not None:
            self.tree.unlock(held.node)

    def room(self, n: int) -> bool:
        """At least ``n`` free slots in the drafter's pool, evicting unlocked pairs if need be."""
        short = n - self.allocator.num_free
        if short > 0 and self.tree.evictable:
            self.allocator.free(self.tree.evict(short))
        return self.allocator.num_free >= n

    def flush(self) -> None:
        self.allocator.free(self.tree.reset())

    def forget(self) -> None:
        """Drop every entry, locked or not, freeing nothing: for a pool being reset as a whole."""
        self.tree = PrefixCache()

    @property
    def idle_slots(self) -> int:
        """Slots the cache holds that no running request uses."""
        return self.tree.evictable
