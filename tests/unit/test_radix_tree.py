"""The prefix cache's radix tree on its own: matching, splitting, insertion of duplicates,
locking, LRU eviction and its token accounting."""

import pytest
import torch

from specfw.prefix_cache import PrefixCache


def _t(*xs):
    return torch.tensor(xs, dtype=torch.long)


def test_match_returns_the_longest_cached_prefix_and_splits_an_edge_there():
    c = PrefixCache()
    assert c.match([1, 2, 3]).length == 0
    assert c.insert([1, 2, 3, 4], _t(10, 11, 12, 13)) == 0
    m = c.match([1, 2, 9])
    assert m.slots.tolist() == [10, 11] and m.length == 2
    assert c.match([1, 2, 3, 4, 5]).slots.tolist() == [10, 11, 12, 13]
    assert c.match([7]).length == 0
    assert c.size == 4 and c.evictable == 4  # the split kept every token once


def test_insert_says_how_many_leading_tokens_were_cached_already():
    c = PrefixCache()
    c.insert([1, 2, 3], _t(10, 11, 12))
    # another request computed [1, 2] itself, then went on differently: its first two slots are duplicates
    assert c.insert([1, 2, 5, 6], _t(20, 21, 22, 23)) == 2
    assert c.match([1, 2, 5, 6]).slots.tolist() == [10, 11, 22, 23]
    assert c.match([1, 2, 3]).slots.tolist() == [10, 11, 12]
    assert c.insert([1, 2, 3], _t(30, 31, 32)) == 3  # all there: nothing taken
    assert c.size == 5
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        c.insert([1, 2, 3], _t(1, 2))


def test_eviction_takes_least_recently_used_unlocked_leaves_first():
    c = PrefixCache()
    c.insert([1, 2, 3], _t(10, 11, 12))
    c.insert([1, 2, 7], _t(10, 11, 17))  # shares [1, 2]
    c.insert([5, 6], _t(15, 16))
    c.match([1, 2, 3])  # the [3] leaf and its parent become the most recent
    assert c.evict(1).tolist() == [17]  # the oldest leaf
    assert c.evict(1).tolist() == [15, 16]  # then the next, whole
    assert c.size == 3 and c.match([5]).length == 0 and c.match([1, 2, 7]).length == 2
    assert c.evict(1).tolist() == [12]
    assert c.evict(1).tolist() == [10, 11]  # [1, 2] became a leaf once its children went
    assert c.size == c.evictable == 0


def test_a_locked_prefix_is_never_evicted_and_counts_as_in_use():
    c = PrefixCache()
    c.insert([1, 2, 3, 4], _t(10, 11, 12, 13))
    c.insert([8, 9], _t(18, 19))
    m = c.match([1, 2, 3, 99])  # ends part way along the edge: split after 3 tokens
    c.lock(m.node)
    assert c.evictable == 3  # [4] and [8, 9]
    freed = c.evict(100)
    assert sorted(freed.tolist()) == [13, 18, 19]
    assert c.size == 3 and c.evictable == 0
    assert c.match([1, 2, 3]).slots.tolist() == [10, 11, 12]
    with pytest.raises(RuntimeError, match="locked"):
        c.reset()
    c.unlock(m.node)
    assert c.evictable == 3
    assert sorted(c.reset().tolist()) == [10, 11, 12] and c.size == 0 and c.evictable == 0


def test_a_split_under_a_lock_keeps_the_lock_on_both_halves():
    c = PrefixCache()
    c.insert([1, 2, 3, 4], _t(10, 11, 12, 13))
    whole = c.match([1, 2, 3, 4, 5])
    c.lock(whole.node)
    c.match([1, 2, 6])  # splits the locked edge after [1, 2]
    c.insert([1, 2, 6], _t(20, 21, 26))
    assert c.evict(100).tolist() == [26]  # only the new leaf could go
    c.unlock(whole.node)
    assert c.evictable == c.size == 4


def test_the_pair_cache_keys_each_pair_by_the_tokens_it_depends_on():
    """Pair i (token t_{i+1}, feature f_i) is cached under (t_i, t_{i+1}): a request shares a pair
    only where both tokens match; ``reach`` counts the shared pairs from pair 0, ``take`` hands them
    over (locked) only when all asked for are there, ``give`` frees duplicates, ``room`` evicts."""
    from specfw.kv_cache import SlotAllocator
    from specfw.speculative.pair_cache import PairCache, pair_keys

    assert pair_keys([5, 6, 7, 8], 3) == [(5, 6), (6, 7), (7, 8)]
    alloc = SlotAllocator(16)
    cache = PairCache(alloc)
    a = alloc.alloc(4)  # pairs 0..3 of [1, 2, 3, 4, 5]
    cache.give([1, 2, 3, 4, 5], a, None)
    assert alloc.num_used == 4 and cache.idle_slots == 4
    assert cache.reach([1, 2, 3, 9, 9], 4) == 2  # pair 2 is (3, 9) here, (3, 4) there
    assert cache.take([1, 2, 3, 9], 3) is None  # not all three
    held = cache.take([1, 2, 3, 9], 2)
    assert held.slots.tolist() == a[:2].tolist() and cache.idle_slots == 2
    b = alloc.alloc(2)  # the new request's own pairs 2..3
    cache.give([1, 2, 3, 9, 9], torch.cat([held.slots, b]), held)
    assert cache.idle_slots == 6 and alloc.num_used == 6
    dup = alloc.alloc(3)  # a request that computed pairs 0..2 of [1, 2, 3, 4] itself: all cached already
    cache.give([1, 2, 3, 4], dup, None)
    assert alloc.num_used == 6
    assert cache.room(12) and alloc.num_free >= 12 and cache.idle_slots < 6
    cache.flush()
    assert alloc.num_used == 0 and cache.idle_slots == 0
