import pytest
import torch

from specfw.speculative.budget import DraftBudget, budget_sizes
from specfw.speculative.types import DraftCandidates


def test_budget_sizes():
    assert budget_sizes(2) == [1, 2]
    assert budget_sizes(8) == [1, 2, 4, 8]
    assert budget_sizes(12) == [1, 2, 4, 8, 12]


def test_fixed_budget_always_max():
    b = DraftBudget(8, adaptive=False)
    for _ in range(20):
        assert b.choose(1) == 8
        b.observe(1, 8, 1.0, {1: 1, 2: 2, 4: 3, 8: 4})
    assert b.rates(1) == {}


def _play(b, cost, tokens, steps, batch=1):
    """cost: size → seconds per step; tokens: size → tokens per step (what the hardware and the
    draft deliver). Yields of smaller sizes are reported as the worker does."""
    for _ in range(steps):
        s = b.choose(batch)
        b.observe(batch, s, cost[s], {k: tokens[k] for k in b.sizes if k <= s})


def test_warmup_plays_every_size_largest_first():
    b = DraftBudget(8, warmup=2, explore=0.0)
    order = []
    for _ in range(8):
        s = b.choose(1)
        order.append(s)
        b.observe(1, s, 1.0, {k: 1 for k in b.sizes if k <= s})
    assert order == [8, 8, 4, 4, 2, 2, 1, 1]


COST = {1: 1.0, 2: 1.16, 4: 1.3, 8: 1.5, 16: 2.3}


def test_converges_to_fastest_size_per_batch_size():
    b = DraftBudget(16, explore=0.0)
    _play(b, COST, {1: 1, 2: 1.6, 4: 2.2, 8: 2.4, 16: 2.6}, 40, batch=1)  # 4: 1.69 tok/s per unit
    _play(b, COST, {1: 4, 2: 4.2, 4: 4.4, 8: 4.6, 16: 4.8}, 40, batch=4)  # drafting never pays
    assert b.best(1) == 4 and b.choose(1) == 4
    assert b.best(4) == 1
    assert b.summary()[4] > 20


def test_exploring_the_largest_size_tracks_a_change_in_the_text():
    b = DraftBudget(16, explore=0.2, decay=0.9)
    _play(b, COST, {1: 1, 2: 1.6, 4: 2.2, 8: 2.4, 16: 2.6}, 60)
    assert b.best(1) == 4
    _play(b, COST, {1: 1, 2: 1.9, 4: 2.8, 8: 4.6, 16: 5.0}, 300)  # e.g. the output became repetitive
    assert b.best(1) == 8


def test_a_stale_cost_from_a_slow_warmup_step_is_refreshed():
    b = DraftBudget(8, explore=0.2)
    b.observe(1, 1, 5.0, None)  # the first plain steps happened to be very slow
    b.observe(1, 1, 5.0, None)
    _play(b, {1: 1.0, 2: 1.16, 4: 1.3, 8: 1.5}, {1: 1, 2: 1.1, 4: 1.15, 8: 1.2}, 400)
    assert b.best(1) == 1  # drafting does not pay once plain steps are re-measured


def test_steps_without_a_draft_are_not_counted():
    b = DraftBudget(8, explore=0.0)
    _play(b, COST, {1: 1, 2: 1.6, 4: 2.2, 8: 2.4}, 40)
    before = b.rates(1)
    for _ in range(50):
        b.observe(1, 8, 5.0, None)
    assert b.rates(1) == before


def test_counterfactual_yields_cut_the_accepted_path():
    from specfw.speculative.budget import counterfactual_yields

    # chain a-b-c under the root plus a sibling x of a (scores a > b > x > c)
    c = DraftCandidates(torch.tensor([10, 11, 12, 99]), torch.tensor([-1, 0, 1, -1]), torch.tensor([-0.1, -0.2, -0.3, -0.25]))
    # the target accepted a, b, c: size 2 keeps {a} → 1 + bonus; size 4 keeps {a, b, x} → 2 + bonus;
    # size 5 keeps everything → 3 + bonus
    assert counterfactual_yields([1, 2, 4, 5], 5, [c], [[10, 11, 12]]) == {1: 1, 2: 2, 4: 3, 5: 4}
    # only sizes up to the one played are reported; two requests add up
    assert counterfactual_yields([1, 2, 4, 5], 2, [c, c], [[10, 11, 12], []]) == {1: 2, 2: 3}


def test_candidates_best_keeps_ancestors_and_reindexes():
    # 0:a(-1) 1:b(-1) 2:c(0) 3:d(2) ; d has the best score, so its ancestors come along
    c = DraftCandidates(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, -1, 0, 2]), torch.tensor([-1.0, -0.5, -2.0, 0.0]))
    top = c.best(3)
    assert top.tokens.tolist() == [10, 12, 13]
    assert top.parents.tolist() == [-1, 0, 1]
    assert c.best(10) is c
    assert c.best(1).tokens.tolist() == [11]


def test_step_plan_depth_follows_the_step_size():
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy

    policy = DraftPolicy(TreeShape(5, 4, 8), adaptive=True, confidence_pruning=False)
    depths = {}
    for size in policy.budget.sizes:
        policy._retime = size  # play this size
        plan = policy.plan(1)
        depths[plan.size] = plan.depth
        assert plan.drafts == (size > 1)
    assert depths == {1: 0, 2: 1, 4: 3, 8: 5}
    fixed = DraftPolicy(TreeShape(5, 4, 8), adaptive=False)
    assert fixed.plan(1).size == 8 and fixed.plan(1).depth == 5 and fixed.plan(1).score_floor == float("-inf")


def test_a_fixed_batch_size_plays_the_configured_tree_and_teaches_nothing():
    """``fixed_batches`` (one request's verify measured near-flat at startup): every step of that
    batch size drafts and verifies the whole tree uncut, and its steps leave the learners as they
    were; other batch sizes adapt (warm-up plays the largest size first); with the policy off the
    set is ignored."""
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy
    from specfw.speculative.types import DraftCandidates

    policy = DraftPolicy(TreeShape(5, 4, 8), adaptive=True, fixed_batches=frozenset({1}))
    cands = DraftCandidates(torch.tensor([10, 11, 12]), torch.tensor([-1, 0, 1]), torch.tensor([-0.1, -6.0, -9.0]))  # a chain, deep nodes unlikely
    for step in range(30):
        plan = policy.plan(1)
        assert (plan.size, plan.depth, plan.cut) == (8, 5, None) and plan.score_floor == float("-inf")
        kept = policy.select(cands, plan)
        assert kept.tokens.tolist() == [10, 11, 12]  # no confidence cut
        policy.observe(1, plan, True, [kept], [[10]], 0.02 if step % 2 else 0.5)
    assert 1 not in policy.budget.played and 1 not in policy.budget.cost and policy.budget.chosen[1] == 0
    assert policy.pruning.kept_nodes == 0 and policy._spent == 0.0 and policy.accepted_mean is not None
    assert policy.plan(2).size == 8 and policy.budget.played[2] == {1: 0, 2: 0, 8: 0}  # batch 2: the budget's own warm-up
    off = DraftPolicy(TreeShape(5, 4, 8), adaptive=False, fixed_batches=frozenset({1}))
    assert off.fixed_batches == frozenset()


def test_policy_select_is_the_one_cut_of_the_candidates():
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy
    from specfw.speculative.types import DraftCandidates, StepPlan

    policy = DraftPolicy(TreeShape(3, 2, 4), adaptive=False)
    cands = DraftCandidates(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 2]), torch.tensor([-0.1, -2.0, -0.5, -3.0, -0.9]))
    kept = policy.select(cands, StepPlan(size=4, depth=3))
    assert kept.tokens.tolist() == [10, 12, 14]  # the best 3, closed under ancestors
    assert len(policy.select(cands, StepPlan(size=1, depth=0))) == 0


def test_a_step_with_an_unrepresentative_time_counts_its_yield_only():
    b = DraftBudget(8, sizes=[1, 8], explore=0.0)
    assert b.sizes == [1, 8]
    b.observe(1, 8, 0.030, {1: 1, 8: 3})
    b.observe(1, 8, None, {1: 1, 8: 1})  # e.g. the drafter caught up after plain steps
    assert b.cost[1][8].mean == 0.030
    assert b.yields[1][8].mean < 3 and b.played[1][8] == 2


def _drafted_share(draft_rate: float, steps: int = 4000) -> float:
    """Share of steps a [1, 8] budget drafts where plain steps are best and drafting measures
    ``draft_rate`` times plain's tokens/s."""
    b = DraftBudget(8, sizes=[1, 8], explore=0.1)
    cost, tokens = {1: 1.0, 8: 2.0}, {1: 1, 8: 2 * draft_rate}
    _play(b, cost, tokens, 20)
    drafted = 0
    for _ in range(steps):
        s = b.choose(1)
        drafted += s > 1
        b.observe(1, s, cost[s], {k: tokens[k] for k in b.sizes if k <= s})
    assert b.best(1) == 1
    return drafted / steps


def test_exploring_a_size_that_measured_much_slower_is_rarer():
    close, far = _drafted_share(0.99), _drafted_share(0.75)
    assert 0.07 < close < 0.13  # the base rate: sizes within a few % of each other
    assert 0.01 < far < 0.035  # 25% slower: the floor, a fifth of the base rate, but never zero
    b = DraftBudget(8, sizes=[1, 8])
    assert b.explore_weight(1, 1, 8) == 1.0  # nothing measured yet: full rate
    _play(b, {1: 1.0, 8: 2.0}, {1: 1, 8: 1.0}, 4)  # warm-up: two steps of each, drafting 0.5x
    assert b.best(1) == 1 and b.explore_weight(1, 1, 8) == 1.0  # two plays of a noisy yield are not enough


def test_a_new_batch_size_starts_from_its_nearest_warm_neighbour():
    """Concurrency that moves (requests finishing one by one) meets batch sizes for a few steps
    each: a new one within a factor of 2 of a warm one plays plain steps, then starts from the
    neighbour's tables (costs scaled by the two plain steps' ratio, yields by the batch sizes')
    instead of warming up on the largest tree; its own steps then take over. Farther away, or
    off, it warms up largest first."""
    plain_pays = {1: 8, 2: 8.5, 4: 9, 8: 9.5}  # 8 requests: drafting does not pay
    cost = {1: 1.0, 2: 1.6, 4: 2.5, 8: 4.0}
    seeded = DraftBudget(8, explore=0.0)
    _play(seeded, cost, plain_pays, 30, batch=8)
    assert seeded.best(8) == 1
    seven = []
    for _ in range(6):
        seven.append(seeded.choose(7))
        seeded.observe(7, seven[-1], 0.9 * cost[seven[-1]], {k: plain_pays[k] * 7 / 8 for k in seeded.sizes if k <= seven[-1]})
    assert seven == [1] * 6  # no warm-up on the largest tree
    assert seeded.rates(7)[8] == pytest.approx(seeded.rates(8)[8] * (7 / 8) / 0.9, rel=0.05)  # the neighbour's, scaled
    assert seeded.choose(3) == 8  # 3 is more than a factor of 2 from 7 and 8: its own warm-up
    # where drafting does pay at the new batch size, its own steps take over from the prior
    moving = DraftBudget(8, explore=0.2, seed=1)
    _play(moving, cost, plain_pays, 30, batch=8)
    _play(moving, {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}, {1: 5, 2: 9, 4: 12, 8: 13}, 300, batch=5)
    assert moving.best(5) == 4
    cold = DraftBudget(8, explore=0.0, seed_new_batch_sizes=False)
    _play(cold, cost, plain_pays, 30, batch=8)
    assert cold.choose(7) == 8


def test_a_new_batch_size_inherits_its_neighbours_exploring_verdict():
    """A seeded batch size counts its neighbour's plays towards being confident, so where drafting
    measured far slower it explores at the floor rate from its first steps, not at the full rate
    for 8 plays of its own (batch sizes of a wave's tail are met for a few steps each)."""
    cost, plain_pays = {1: 1.0, 8: 2.7}, {1: 8, 8: 9.5}
    seeded = DraftBudget(8, sizes=[1, 8], explore=0.5, seed=2)
    _play(seeded, cost, plain_pays, 60, batch=8)
    seeded.explore = 0.0
    assert seeded.played[8][8] >= seeded.explore_confident_after and seeded.explore_weight(8, 1, 8) == seeded.explore_floor
    for _ in range(3):  # plain steps first, then the neighbour's tables
        s = seeded.choose(7)
        seeded.observe(7, s, 0.9 * cost[s], {k: plain_pays[k] * 7 / 8 for k in seeded.sizes if k <= s})
    assert seeded.played[7][8] < seeded.explore_confident_after  # its own plays alone would not be enough
    assert seeded.explore_weight(7, 1, 8) == seeded.explore_floor
    cold = DraftBudget(8, sizes=[1, 8], explore=0.5, seed=2, seed_new_batch_sizes=False)
    _play(cold, cost, plain_pays, 60, batch=8)
    cold.explore = 0.0
    _play(cold, cost, plain_pays, 4, batch=7)  # its own warm-up: two plays of each size
    assert cold.explore_weight(7, 1, 8) == 1.0


def _switch(policy, batch: int, size: int) -> int:
    """A plain step, then a drafted step of ``size`` (its time not counted: the drafter caught up);
    returns the size the policy then replays (0: none)."""
    from specfw.speculative.types import StepPlan

    empty = [DraftCandidates.empty()] * batch
    policy.observe(batch, StepPlan(size=1, depth=0), False, empty, [[]] * batch, 0.010)
    cands = [DraftCandidates(torch.tensor([5]), torch.tensor([-1]), torch.tensor([-0.1]))] * batch
    policy.observe(batch, StepPlan(size=size, depth=1), True, cands, [[5]] * batch, 0.030)
    return policy._retime


def test_a_switching_step_is_replayed_to_be_timed_until_its_cost_is_known():
    """The step after plain steps is not timed (it paid for catching up); the next replays its size
    to time it while fewer than ``RETIME_KNOWN`` of its steps were timed at this batch size, then
    only on ``retime_share`` of such switches."""
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import RETIME_KNOWN, DraftPolicy
    from specfw.speculative.types import StepPlan

    never = DraftPolicy(TreeShape(3, 1, 4), confidence_pruning=False, retime_share=0.0)
    always = DraftPolicy(TreeShape(3, 1, 4), confidence_pruning=False, retime_share=1.0)
    for policy in (never, always):
        assert _switch(policy, 2, 4) == 4  # nothing timed yet: replay
        assert not policy.budget.times_known(2, 4, 1)
        for _ in range(RETIME_KNOWN):
            policy._retime = 0
            policy.observe(2, StepPlan(size=4, depth=3), True, [DraftCandidates.empty()] * 2, [[]] * 2, 0.020)  # timed
        assert policy.budget.times_known(2, 4, RETIME_KNOWN)
    assert _switch(never, 2, 4) == 0 and _switch(always, 2, 4) == 4
    assert _switch(never, 3, 4) == 4  # another batch size: its own count
    half = DraftPolicy(TreeShape(3, 1, 4), confidence_pruning=False, retime_share=0.25, seed=3)
    half.budget.timed[2] = {4: RETIME_KNOWN}
    replays = sum(_switch(half, 2, 4) == 4 for _ in range(400))
    assert 60 < replays < 140


def _exploring_cost(explore_budget: float, draft_pays: bool = False, steps: int = 3000, seed: int = 0) -> tuple[float, int]:
    """A [1, 8] policy (pruning off) where a plain step takes 5 ms for 1 token and a drafted one
    14 ms for 2 tokens (or 6 ms for 3 with ``draft_pays``), plus 20 ms of catching up when it
    follows plain steps. Returns (the share of time spent beyond what plain steps would have taken
    for the drafted steps' tokens, the number of drafted steps)."""
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy

    policy = DraftPolicy(TreeShape(5, 4, 8), confidence_pruning=False, seed=seed, explore_budget=explore_budget)
    drafted_cost, drafted_tokens = (0.006, 3) if draft_pays else (0.014, 2)
    cands = DraftCandidates(torch.tensor([5, 6]), torch.tensor([-1, 0]), torch.tensor([-0.1, -0.2]))
    total = excess = 0.0
    drafted, plain_before = 0, False
    for _ in range(steps):
        plan = policy.plan(1)
        if plan.size == 1:
            seconds, accepted = 0.005, [[]]
        else:
            seconds, accepted = drafted_cost + (0.020 if plain_before else 0.0), [[5, 6][: drafted_tokens - 1]]
            excess += seconds - 0.005 * drafted_tokens
            drafted += 1
        policy.observe(1, plan, plan.size > 1, [cands if plan.size > 1 else DraftCandidates.empty()], accepted, seconds)
        plain_before = plan.size == 1
        total += seconds
    return excess / total, drafted


def test_exploring_costs_at_most_its_budget_where_drafting_does_not_pay():
    """Where plain steps win and leaving them costs a catch-up, the rates' exploring alone spends
    several % of the time on drafted steps; the exploring budget caps that near its share, and
    where drafting pays the policy still drafts (nearly) every step."""
    unbounded = max(_exploring_cost(float("inf"), seed=s)[0] for s in range(3))
    bounded = max(_exploring_cost(0.02, seed=s)[0] for s in range(3))
    assert unbounded > 0.045
    assert bounded < 0.03
    assert _exploring_cost(0.02, seed=0)[1] > 10  # it still explores
    share, drafted = _exploring_cost(0.02, draft_pays=True)
    assert drafted > 0.9 * 3000 and share < 0


def _chain_proposal(p: float, n: int) -> DraftCandidates:
    """An assist's chain of ``n`` tokens, each accepted with probability ``p`` given its parent."""
    return DraftCandidates(torch.arange(n), torch.arange(-1, n - 1), torch.log(torch.tensor([p ** (i + 1) for i in range(n)])))


def _drafter_steps(policy, accepted: int, step: float, draft: float, n: int = 30, batch: int = 1):
    """``n`` steps on which the drafter ran for ``draft`` seconds of a ``step``-second step and
    each request kept ``accepted`` draft tokens."""
    plan = policy.plan(batch)
    cands = [DraftCandidates.chain(list(range(accepted + 1)))] * batch
    for _ in range(n):
        policy.drafter_ran(draft)
        policy.observe(batch, plan, True, cands, [list(range(accepted))] * batch, step)


def test_an_assist_skips_the_drafter_where_its_tokens_per_second_beat_the_drafters():
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy

    proposal = _chain_proposal(0.9, 3)  # expected 0.9 + 0.81 + 0.73 = 2.44 tokens, + the target's own
    # a self-draft: 5 accepted (6 tokens) in 60 ms, 33 of them drafting -> 0.1 tokens/ms; the
    # proposal alone: 3.44 tokens in ~27 ms -> 0.13 tokens/ms: skip the drafter
    expensive = DraftPolicy(TreeShape(5, 1, 6), adaptive=False)
    _drafter_steps(expensive, accepted=5, step=0.060, draft=0.033)
    assert expensive.assist_suffices(proposal, 1)
    # a cheap head: 2 accepted (3 tokens) in 30 ms, 3 drafting -> 0.1 tokens/ms; the proposal alone
    # 3.44 in 27 ms -> 0.127: skip too; but one worth 1.18 tokens (2.18 in 27 ms: 0.081) does not
    cheap = DraftPolicy(TreeShape(5, 1, 6), adaptive=False)
    _drafter_steps(cheap, accepted=2, step=0.030, draft=0.003)
    assert cheap.assist_suffices(proposal, 1)
    assert not cheap.assist_suffices(_chain_proposal(0.6, 3), 1)  # 0.6 + 0.36 + 0.22 = 1.18 expected
    # the expected-tokens rule (2.44 < 5 accepted) kept the expensive drafter running every step
    assert proposal.scores.exp().sum() < expensive.accepted_mean
    # no proposal never suffices
    assert not expensive.assist_suffices(DraftCandidates.empty(), 1)


def test_with_a_batch_an_assist_must_match_the_drafted_steps_mean():
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy

    policy = DraftPolicy(TreeShape(5, 1, 6), adaptive=False)
    _drafter_steps(policy, accepted=5, step=0.060, draft=0.033, batch=2)
    assert policy.drafter_steps is None  # a batch's steps are not one request's drafter rate
    assert not policy.assist_suffices(_chain_proposal(0.9, 3), 2)  # 2.44 expected < 5
    assert policy.assist_suffices(_chain_proposal(0.99, 6), 2)  # 5.8 expected >= 5


def _yield_table(policy, size: int) -> tuple[float, float] | None:
    entry = policy.budget.yields.get(1, {}).get(size)
    return None if entry is None else (entry.total, entry.weight)


def test_steps_cut_at_random_do_not_teach_the_budget():
    """Before the node-cost fit has data, and on exploring steps, confidence pruning keeps a random
    number of the best nodes (for the fit's spread and the calibration). Such a step yields and
    costs what its random cut let through, not what a drafted step does under the steady cut: fed
    to the draft budget, a self-draft's chain accepted in full looked slower than plain steps after
    a cold start (a fresh engine played ~100 of its first 130 MT-bench steps plain; session 48).
    The budget learns from steps cut by confidence only; the pruning's learners see every step."""
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy

    policy = DraftPolicy(TreeShape(5, 1, 6))
    chain = DraftCandidates(torch.arange(5), torch.arange(-1, 4), torch.log(torch.tensor([0.6, 0.4, 0.3, 0.2, 0.1])))
    random_cuts = steady = 0
    steady_total = steady_weight = 0.0  # the steady steps' tokens, decayed as the budget's table
    for _ in range(80):
        plan = policy.plan(1)
        if plan.size == 1:  # the warm-up's plain steps
            policy.observe(1, plan, False, [DraftCandidates.empty()], [[]], 0.018)
            continue
        kept = policy.select(chain, plan)
        at_random = plan.cut.keep is not None
        if plan.size < 6:  # a one-token step (never cut) teaches the budget its own size
            assert plan.size == 2 and not at_random
            policy.observe(1, plan, True, [kept], [kept.tokens.tolist()], 0.030 + 0.004 * len(kept))
            continue
        random_cuts, steady = random_cuts + at_random, steady + (not at_random)
        if not at_random:
            steady_total, steady_weight = steady_total * policy.budget.decay + len(kept) + 1, steady_weight * policy.budget.decay + 1
        table_before = _yield_table(policy, 6)
        policy.observe(1, plan, True, [kept], [kept.tokens.tolist()], 0.030 + 0.004 * len(kept))
        if at_random:  # the budget's table of the size is as it was
            assert _yield_table(policy, 6) == table_before
    assert random_cuts >= 3 and steady >= 10
    assert policy.budget.played[1][6] == steady  # only the steady steps taught the budget
    assert policy.budget.yields[1][6].mean == pytest.approx(steady_total / steady_weight)
    assert policy.pruning.costs[1].slope is not None  # the cost fit learned from the random cuts


def test_one_node_trees_are_never_cut_at_random():
    from specfw.speculative.confidence import ConfidencePruning, Cut

    assert {ConfidencePruning(explore=1.0).plan(1, 50.0, 1) for _ in range(20)} == {Cut()}


def test_pruning_policy_offers_one_draft_token_and_plays_it_where_it_pays():
    """With confidence pruning the budget chooses between plain steps, one draft token (a depth-1
    draft, never cut) and the whole pruned tree; where one-token steps measure the best tokens/s
    (e.g. many requests in flight on a CPU, where every extra verify row costs) the policy plays
    them, and a shape with no room for more than one token offers no duplicate size."""
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy
    from specfw.speculative.types import DraftCandidates

    policy = DraftPolicy(TreeShape(5, 4, 8), adaptive=True, explore_budget=0.0)
    assert policy.budget.sizes == [1, 2, 8]
    assert DraftPolicy(TreeShape(1, 1, 2), adaptive=True).budget.sizes == [1, 2]
    policy._retime = 2
    plan = policy.plan(8)
    assert (plan.size, plan.depth) == (2, 1) and plan.cut.threshold == 0 and plan.cut.keep is None
    chain = DraftCandidates(torch.tensor([10, 11, 12]), torch.tensor([-1, 0, 1]), torch.tensor([-5.0, -6.0, -9.0]))
    assert policy.select(chain, plan).tokens.tolist() == [10]  # the best one, however unlikely
    # teach the budget: at 8 requests plain steps 10 ms for 8 tokens, one-token steps 11 ms for
    # 12 tokens, whole trees 20 ms for 14 tokens
    for size, seconds, tokens in [(1, 0.010, 8), (2, 0.011, 12), (8, 0.020, 14)]:
        for _ in range(10):
            policy.budget.observe(8, size, seconds, {size: tokens})
    plays = [policy.plan(8).size for _ in range(50)]
    assert plays.count(2) == 50


def test_one_token_steps_do_not_teach_the_node_cost_fit():
    """A one-token step drafts at depth 1, cheaper than the whole tree's draft: its time beside the
    tree's would charge that saving to the tree's extra nodes, so only whole-tree steps feed the
    pruning's node-cost fit; every drafted step's nodes still calibrate acceptance."""
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy
    from specfw.speculative.types import DraftCandidates

    policy = DraftPolicy(TreeShape(5, 4, 8), adaptive=True)
    one = DraftCandidates(torch.tensor([10]), torch.tensor([-1]), torch.tensor([-0.2]))
    policy._retime = 2
    plan = policy.plan(4)
    assert plan.size == 2
    seen = sum(policy.pruning.calibration.seen)
    policy.observe(4, plan, True, [one] * 4, [[10]] * 4, 0.020)
    assert 4 not in policy.pruning.costs  # no node-cost sample
    assert sum(policy.pruning.calibration.seen) == pytest.approx(seen + 4, rel=0.01)  # but four calibration samples (decayed)
    assert policy.budget.timed[4][2] == 1  # and the budget timed the size
    policy._retime = 8
    plan = policy.plan(4)
    assert plan.size == 8
    kept = policy.select(DraftCandidates(torch.tensor([10, 11]), torch.tensor([-1, 0]), torch.tensor([-0.2, -0.5])), plan)
    policy.observe(4, plan, True, [kept] * 4, [[10]] * 4, 0.030)
    assert policy.pruning.costs[4].w > 0  # a whole-tree step does teach the fit
