"""The ngram plugin's trie: counts, recency order, matching, drafting and LRU eviction, checked
against a model of the same rules over token tuples (one dict entry per path)."""

from __future__ import annotations

import gc
import math
import random
from collections import OrderedDict

import pytest

from specfw_plugins.ngram.trie import ROOT, NgramTrie


class PathModel:
    """The trie's rules over paths as tuples: every position starts a path of up to ``depth``
    tokens; each extension touches a path (count + 1, most recent); over capacity the least
    recently touched path goes with every path it prefixes."""

    def __init__(self, depth: int, capacity: int):
        self.depth, self.capacity = depth, capacity
        self.count: dict[tuple, int] = {}
        self.order: OrderedDict[tuple, None] = OrderedDict()
        self.created: dict[tuple, int] = {}
        self.clock = 0

    def extend(self, open_paths: list[tuple], tokens: list[int]) -> list[tuple]:
        """``open_paths``: (path, its creation number); a path evicted and made again is another path."""
        paths = [p for p, made in open_paths if self.created.get(p) == made and p in self.count]
        for t in tokens:
            paths = [p + (t,) for p in paths if len(p) < self.depth] + [(t,)]
            for p in paths:
                if p not in self.count:
                    self.count[p], self.created[p] = 0, self.clock
                    self.clock += 1
                self.count[p] += 1
                self.order[p] = None
                self.order.move_to_end(p)
        while len(self.count) > self.capacity:
            old, _ = self.order.popitem(last=False)
            for p in [p for p in self.count if p[: len(old)] == old]:
                del self.count[p]
                self.order.pop(p, None)
        return [(p, self.created[p]) for p in paths if p in self.count]

    def children(self, path: tuple) -> list[int]:
        kids = [p for p in self.count if len(p) == len(path) + 1 and p[:-1] == path]
        return [p[-1] for p in sorted(kids, key=self.created.__getitem__, reverse=True)]


def _path(trie: NgramTrie, node: int) -> tuple:
    out = []
    while node != ROOT:
        out.append(trie.token[node])
        node = trie.parent[node]
    return tuple(reversed(out))


def _live(trie: NgramTrie) -> dict[tuple, int]:
    return {_path(trie, n): trie.count[n] for n in range(1, trie.top) if trie.alive(n)}


def _check_structure(trie: NgramTrie) -> None:
    """Every edge names a live node under a live parent, every live node has its edge and is in
    its parent's child list once."""
    live = [n for n in range(1, trie.top) if trie.alive(n)]
    assert len(live) == len(trie) == len(trie.edges)
    for n in live:
        p = trie.parent[n]
        assert trie.alive(p) and trie.edges[p << 32 | trie.token[n]] == n
        assert trie.children(p).count(n) == 1 and trie.depth[n] == trie.depth[p] + 1


def _feed(seed: int, depth: int, capacity: int, vocab: int, steps: int = 150):
    rng = random.Random(seed)
    trie, model = NgramTrie(depth, capacity), PathModel(depth, capacity)
    seqs: dict[int, tuple[list, list]] = {}
    for _ in range(steps):
        rid = rng.randrange(3)
        handles, paths = seqs.get(rid, ([], []))
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        handles, paths = trie.extend(handles, tokens), model.extend(paths, tokens)
        seqs[rid] = (handles, paths)
        assert len(handles) == len(paths)
        yield trie, model


@pytest.mark.parametrize("depth,capacity,vocab", [(18, 10_000_000, 5), (3, 10_000_000, 4), (4, 40, 6), (18, 25, 3), (2, 7, 9)])
def test_trie_keeps_the_paths_counts_and_recency_the_rules_give(depth, capacity, vocab):
    for seed in range(4):
        for trie, model in _feed(seed, depth, capacity, vocab, steps=150 if capacity < 1000 else 40):
            assert len(trie) <= capacity
            assert _live(trie) == model.count
        _check_structure(trie)
        for n in [ROOT] + [n for n in range(1, trie.top) if trie.alive(n)]:
            assert [trie.token[c] for c in trie.children(n)] == model.children(_path(trie, n))


def test_an_evicted_paths_handle_is_not_extended_after_its_id_is_reused():
    trie = NgramTrie(branch_length=5, capacity=6)
    stale = trie.extend([], [1, 2, 3])  # 1, 2, 3, 1-2, 2-3, 1-2-3: six nodes
    other = []
    for t in [7, 8, 9, 7, 8, 9]:  # evicts every node of the first sequence, reusing their ids
        other = trie.extend(other, [t])
    assert not any(trie.alive(h & ((1 << 32) - 1)) and _path(trie, h & ((1 << 32) - 1))[:1] == (1,) for h in stale)
    before = _live(trie)
    trie.extend(stale, [4])  # only the fresh path (4,) is made: no stale handle grows a reused node
    after = _live(trie)
    assert set(after) - set(before) <= {(4,)} and (4,) in after
    _check_structure(trie)


def test_match_finds_every_suffix_with_continuations_longest_first():
    trie = NgramTrie(branch_length=6)
    trie.extend([], [5, 6, 7, 8, 5, 6, 9])
    anchors = trie.match([1, 5, 6], 1, 4)  # (5, 6) continues with 7 and 9, (6,) too; (1, 5, 6) was never seen
    assert [(w, _path(trie, node)) for node, w in anchors] == [(2, (5, 6)), (1, (6,))]
    node = anchors[0][0]
    assert [trie.token[c] for c in trie.children(node)] == [9, 7]  # most recent first
    assert trie.match([3, 4], 1, 4) == []
    assert trie.match([6, 9], 1, 4) == []  # (6, 9) and (9,) end the sequence: nothing follows them
    assert [w for _, w in trie.match([5, 6], 2, 2)] == [2] and trie.match([5, 6], 3, 4) == []


def test_draft_bfs_takes_the_most_recent_children_and_scores_path_frequencies():
    trie = NgramTrie(branch_length=4)
    trie.extend([], [1, 2, 3, 1, 2, 3, 1, 4, 5, 1, 2, 6])  # after 1: 2 three times, 4 once (4 newer)
    ((node, _),) = trie.match([1], 1, 1)
    tokens, parents, scores = trie.draft_bfs([(node, 1)], budget=10)
    assert tokens == [4, 5, 1] and parents == [-1, 0, 1]  # breadth 1: the newest child at each level
    assert scores[0] == pytest.approx(math.log(1 / 4))
    tokens, parents, scores = trie.draft_bfs([(node, 2)], budget=3)
    assert tokens == [4, 2, 5] and parents == [-1, -1, 0]  # breadth-first, cut at the budget
    assert scores[1] == pytest.approx(math.log(3 / 4))


def test_shorter_matches_continue_the_longer_ones_past_their_branch_length():
    """A window of w tokens was stored with branch_length - w tokens after it: in a quote, the
    longest match's continuation ends early and the shorter ones' go on (one tree, merged)."""
    trie = NgramTrie(branch_length=4)
    trie.extend([], [9, 1, 2, 3, 4, 5, 6])
    anchors = trie.match([7, 1, 2], 1, 3)  # (1, 2) then (2,)
    assert [w for _, w in anchors] == [2, 1]
    tokens, parents, scores = trie.draft_bfs([(n, 1) for n, _ in anchors], budget=10)
    assert tokens == [3, 4, 5] and parents == [-1, 0, 1]  # (1, 2) alone: [3, 4]; (2,) adds the 5
    assert trie.draft_bfs([(anchors[0][0], 1)], budget=10)[0] == [3, 4]
    assert trie.draft_bfs([(n, 1) for n, _ in anchors], budget=2)[0] == [3, 4]
    assert trie.draft_chain([n for n, _ in anchors], budget=10) == [3, 4, 5]
    assert trie.draft_prob([n for n, _ in anchors], budget=10)[0] == [3, 4, 5]
    trie.extend([], [2, 8])  # (2,) now continues with 8 more recently: a branch, not the chain
    anchors = trie.match([7, 1, 2], 1, 3)
    tokens, parents, _ = trie.draft_bfs([(n, 2) for n, _ in anchors], budget=10)
    assert list(zip(tokens, parents)) == [(3, -1), (4, 0), (8, -1), (5, 1)]
    assert trie.draft_chain([n for n, _ in anchors], budget=10) == [3, 4, 5]  # the longest match's path, then its extension


def test_merged_scores_never_rise_along_a_path():
    trie = NgramTrie(branch_length=5)
    rng = random.Random(1)
    seq = [rng.randrange(6) for _ in range(300)]
    trie.extend([], seq)
    anchors = trie.match(seq[-10:], 1, 4)
    assert len(anchors) > 1
    for tokens, parents, scores in (
        trie.draft_bfs([(n, 3) for n, _ in anchors], budget=30),
        trie.draft_prob([n for n, _ in anchors], budget=30),
    ):
        assert len(tokens) == 30 and all(p < i for i, p in enumerate(parents))
        assert len(set(zip(parents, tokens))) == 30  # no duplicate continuation
        assert all(scores[i] <= scores[p] for i, p in enumerate(parents) if p >= 0)


def test_draft_prob_is_best_first_by_path_probability():
    trie = NgramTrie(branch_length=4)
    trie.extend([], [1, 2, 3, 1, 2, 3, 1, 4, 5, 1, 2, 6])
    ((node, _),) = trie.match([1], 1, 1)
    tokens, parents, scores = trie.draft_prob([node], budget=4)
    # 2 (3/4), 2-3 (3/4 * 2/3), 2-3-1 (the same 1/2: seen after 2-3), then 4 (1/4) before 2-6
    assert tokens == [2, 3, 1, 4] and parents == [-1, 0, 1, -1]
    assert scores == pytest.approx([math.log(p) for p in (3 / 4, 1 / 2, 1 / 2, 1 / 4)])
    assert all(a >= b for a, b in zip(scores, scores[1:]))


def test_trie_nodes_are_not_objects_the_garbage_collector_tracks():
    trie = NgramTrie(branch_length=18)
    rng = random.Random(0)
    handles: list[int] = []
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(2_000):
        handles = trie.extend(handles, [rng.randrange(500)])
    gc.collect()
    assert len(trie) > 20_000
    assert len(gc.get_objects()) - before < 100  # no tracked object per node: full collections stay cheap
    # nor containers whose every element a full collection visits (the edges dict holds only ints)
    assert not gc.is_tracked(trie.edges)
    assert all(len(gc.get_referents(c)) <= 1 for c in trie._columns)  # an array's referents: its type alone
