import torch

from specfw.spec.budget import DraftBudget, budget_sizes
from specfw.spec.types import DraftCandidates


def test_budget_sizes():
    assert budget_sizes(2) == [1, 2]
    assert budget_sizes(8) == [1, 2, 4, 8]
    assert budget_sizes(12) == [1, 2, 4, 8, 12]


def test_fixed_budget_always_max():
    b = DraftBudget(8, adaptive=False)
    for _ in range(20):
        assert b.choose(1) == 8
        b.observe(1, 8, 1, 1.0)
    assert b.rates(1) == {}


def _play(b, speed, steps, batch=1, drafted=True):
    """speed: size → tokens per second the 'hardware' delivers."""
    for _ in range(steps):
        s = b.choose(batch)
        b.observe(batch, s, speed[s], 1.0, drafted=drafted)


def test_warmup_tries_every_size_largest_first():
    b = DraftBudget(8, warmup=2, explore=0.0)
    order = []
    for _ in range(8):
        s = b.choose(1)
        order.append(s)
        b.observe(1, s, 1, 1.0)
    assert order == [8, 8, 4, 4, 2, 2, 1, 1]


def test_converges_to_fastest_size_per_batch_size():
    b = DraftBudget(16, explore=0.0)
    _play(b, {1: 30, 2: 40, 4: 50, 8: 45, 16: 35}, 40, batch=1)
    _play(b, {1: 100, 2: 90, 4: 60, 8: 40, 16: 20}, 40, batch=4)
    assert b.best(1) == 4 and b.choose(1) == 4
    assert b.best(4) == 1      # drafting does not pay at this batch size: plain steps
    assert b.summary()[4] > 20


def test_exploration_reaches_neighbours_and_tracks_change():
    b = DraftBudget(8, explore=0.3, decay=0.8)
    _play(b, {1: 30, 2: 40, 4: 50, 8: 45}, 60)
    assert b.best(1) == 4
    _play(b, {1: 30, 2: 40, 4: 50, 8: 70}, 200)   # e.g. the text became repetitive
    assert b.best(1) == 8


def test_steps_without_a_draft_do_not_rank_sizes():
    b = DraftBudget(8, explore=0.0)
    _play(b, {1: 30, 2: 40, 4: 50, 8: 45}, 40)
    for _ in range(50):   # many undrafted steps at size 8 that happen to be slow
        b.observe(1, 8, 1, 1.0, drafted=False)
    assert b.best(1) == 4


def test_candidates_best_keeps_ancestors_and_reindexes():
    # 0:a(-1) 1:b(-1) 2:c(0) 3:d(2) ; d has the best score, so its ancestors come along
    c = DraftCandidates(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, -1, 0, 2]),
                        torch.tensor([-1.0, -0.5, -2.0, 0.0]))
    top = c.best(3)
    assert top.tokens.tolist() == [10, 12, 13]
    assert top.parents.tolist() == [-1, 0, 1]
    assert c.best(10) is c
    assert c.best(1).tokens.tolist() == [11]
