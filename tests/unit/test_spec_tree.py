"""Default tree building (selection, masks, depths, retrieve links) and KV keep/free on commit."""

import torch

from specfw.speculative.tree import build_tree, select_candidates
from specfw.speculative.types import DraftCandidates


def _cands(tokens, parents, scores):
    return DraftCandidates(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores, dtype=torch.float32))


def test_tree_tensors():
    # root → a(10), b(20); a → c(30); c → d(40)
    t = build_tree(7, _cands([10, 20, 30, 40], [-1, -1, 0, 2], [-0.1, -0.5, -0.2, -0.3]), size=5)
    assert t.tokens.tolist() == [7, 10, 20, 30, 40]
    assert t.parents.tolist() == [-1, 0, 0, 1, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 3]
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(t.mask, expect)
    assert t.retrieve_next_token.tolist() == [1, 3, -1, 4, -1]
    assert t.retrieve_next_sibling.tolist() == [-1, 2, -1, -1, -1]
    assert t.children(0) == [1, 2] and t.children(1) == [3] and not t.is_chain


def test_selection_keeps_best_and_is_ancestor_closed():
    # a strong grandchild under a weak parent pulls the parent in when the budget allows
    c = _cands([1, 2, 3, 4], [-1, -1, 1, -1], [-0.5, -3.0, -0.6, -2.0])
    assert select_candidates(c, 3) == [0, 1, 2]
    assert select_candidates(c, 2) == [0, 3]  # grandchild needs 2 slots: skipped, next best taken
    t = build_tree(9, c, size=3)
    assert t.parents.tolist() == [-1, 0, 0] and t.tokens.tolist() == [9, 1, 4]


def _best_reference(tokens, parents, scores, n):
    """The rule on sets: in torch's stable descending score order (ties: the earlier candidate), a
    candidate joins with the ancestors it lacks while they fit the budget."""

    def lineage(i):  # i and all its ancestors
        return {i} | lineage(parents[i]) if i >= 0 else set()

    chosen = set()
    for i in torch.argsort(torch.tensor(scores), descending=True, stable=True).tolist():
        if len(chosen) < n and len(chosen | lineage(i)) <= n:
            chosen |= lineage(i)
    keep = sorted(chosen)
    return [tokens[i] for i in keep], [keep.index(parents[i]) if parents[i] >= 0 else -1 for i in keep], [scores[i] for i in keep]


def test_best_is_the_reference_rule_with_ties_and_keeps_dtypes():
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 50)
        parents = [-1 if i < 2 or rng.random() < 0.25 else rng.randrange(i) for i in range(n)]
        scores = [rng.choice([-0.5, -1.0, -1.5, -2.0, -2.5]) - 0.125 * rng.randint(0, 3) for _ in range(n)]  # many ties
        tokens = [rng.randrange(50_000) for _ in range(n)]
        c = _cands(tokens, parents, scores)
        budget = rng.randint(1, 12)
        b = c.best(budget)
        if n <= budget:
            assert b is c
            continue
        assert (b.tokens.tolist(), b.parents.tolist(), b.scores.tolist()) == _best_reference(tokens, parents, scores, budget)
        assert b.tokens.dtype == torch.long and b.parents.dtype == torch.long and b.scores.dtype == torch.float32
    probs = torch.rand(4, 10)
    c = DraftCandidates(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, -1, 2]), torch.tensor([-0.1, -0.2, -0.3, -0.9]), probs)
    kept = c.best(2)  # the draft distributions follow their candidates
    assert kept.tokens.tolist() == [1, 2] and torch.equal(kept.draft_probs, probs[[0, 1]])


def test_chain_and_empty():
    t = build_tree(5, DraftCandidates.chain([6, 7, 8]), size=10)
    assert t.is_chain and t.depth.tolist() == [0, 1, 2, 3]
    assert torch.equal(t.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    e = build_tree(5, DraftCandidates.empty(), size=4)
    assert len(e) == 1 and e.tokens.tolist() == [5]


def test_kv_commit_keeps_accepted_path_in_order(tiny_model_dir):
    """After a verify step, the request's slot table = previous slots + accepted nodes' slots,
    and every other tree slot is back in the pool."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw_plugins.ngram.config import NgramConfig

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=2048, speculative=NgramConfig(algorithm="ngram", num_draft_tokens=6)))
    free0 = eng.runner.allocator.num_free
    req = eng.add_request(eng.make_request([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)))
    eng.step()  # prefill
    seen = []
    while eng.has_work:
        before = req.slots.slots().clone()
        used_before = eng.runner.allocator.num_used
        outs = eng.step()
        if req.finished:
            break
        after = req.slots.slots()
        assert torch.equal(after[: len(before)], before)  # prefix untouched
        n_new = len(after) - len(before)
        assert n_new == len(outs[0].new_token_ids)  # root + accepted drafts cached
        assert eng.runner.allocator.num_used == used_before + n_new  # rejected nodes freed
        seen.append(n_new)
    assert eng.runner.allocator.num_free + eng.scheduler.cache.size == free0 and eng.scheduler.kv_in_use == 0  # the rest is cached
    assert max(seen) > 1  # some drafts were accepted
