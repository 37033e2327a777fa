"""The drafter's own KV slots, seen from the engine: how many running requests hold (the pair
cache's idle slots excluded). Used by the server's health snapshot and leak reclaim, and by tests;
no server dependency, so it runs wherever the engine does."""

from __future__ import annotations


def draft_kv_in_use(engine) -> int:
    """Draft KV slots running requests hold: the drafter's allocated slots less those its pair
    cache keeps for later requests (speculative/pair_cache.py)."""
    alloc = draft_allocator(engine)
    if alloc is None:
        return 0
    cache = pair_cache(engine)
    return alloc.num_used - (cache.idle_slots if cache is not None else 0)


def pair_cache(engine):
    """The EAGLE-family drafter's pair cache, if the algorithm runtime keeps one."""
    return getattr(getattr(engine.worker, "runtime", None), "pair_cache", None)


def draft_allocator(engine):
    """The slot allocator of the drafter's own KV pool, if the algorithm runtime has one (the
    EAGLE family keeps a ``kv`` pool, a standalone draft model a runner with an ``allocator``)."""
    runtime = getattr(engine.worker, "runtime", None)
    for holder in (getattr(runtime, "kv", None), getattr(runtime, "draft", None)):
        alloc = getattr(holder, "allocator", None)
        if alloc is not None and hasattr(alloc, "num_used"):
            return alloc
    return None
