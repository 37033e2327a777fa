"""Confidence pruning (speculative/confidence.py): calibration, the cost fit, the pruning rule, the beam
search's score floor, and greedy == plain with pruning active on the demo model's EAGLE-3 draft."""

import math

import pytest
import torch

from specfw.speculative.confidence import AcceptanceCalibration, ConfidencePruning, Cut, NodeCost
from specfw.speculative.types import DraftCandidates


def test_calibration_starts_at_the_draft_probability_and_learns_acceptance():
    cal = AcceptanceCalibration()
    assert cal.prob(math.log(0.95)) > 0.9 and cal.prob(math.log(0.005)) < 0.01
    for i in range(400):  # the draft says 5%, the target accepts half of these nodes
        cal.observe(math.log(0.05), accepted=i % 2 == 0)
    assert cal.prob(math.log(0.05)) == pytest.approx(0.5, abs=0.03)
    assert cal.prob(math.log(0.3)) == pytest.approx(0.35, abs=0.01)  # other bins keep their prior


def test_score_floor_is_the_lowest_bin_that_clears_the_threshold_with_all_above():
    cal = AcceptanceCalibration()
    floor = cal.score_floor(0.25)  # prior: a bin's midpoint; the 0.2-0.3 bin is the lowest at >= 0.25
    assert math.exp(floor) == pytest.approx(0.2)
    assert cal.score_floor(0.0) == -math.inf
    for _ in range(200):  # a bin above that turns out never to be accepted stops the scan
        cal.observe(math.log(0.45), accepted=False)
    assert math.exp(cal.score_floor(0.25)) == pytest.approx(0.5)


def test_node_cost_fits_the_marginal_seconds_per_node():
    c = NodeCost()
    assert c.slope is None
    for i in range(50):
        c.observe(i % 8, 0.030 + 0.002 * (i % 8))
    assert c.slope == pytest.approx(0.002)
    flat = NodeCost()
    for _ in range(50):
        flat.observe(7, 0.05)  # always the same tree size: no slope to fit
    assert flat.slope is None


def test_node_cost_does_not_charge_the_per_token_work_to_the_nodes():
    """Steps that verify more nodes accept more tokens; the time each produced token costs (its
    KV, the drafter catching up) is not the nodes' marginal cost."""
    c, alone = NodeCost(), NodeCost()
    for i in range(80):
        nodes = i % 12
        tokens = 1 + nodes // 3 + (i // 12) % 3  # grows with the nodes, with its own spread
        seconds = 0.020 + 0.0001 * nodes + 0.002 * tokens
        c.observe(nodes, seconds, tokens)
        alone.observe(nodes, seconds)
    assert c.slope == pytest.approx(0.0001, rel=1e-6)
    assert alone.slope > 0.0005  # the fit on nodes alone: 6x the true cost
    fixed = NodeCost()  # tokens with no spread of their own: the fit on nodes
    for i in range(50):
        fixed.observe(i % 8, 0.030 + 0.002 * (i % 8), tokens=2)
    assert fixed.slope == pytest.approx(0.002)


def test_threshold_is_tokens_per_second_times_seconds_per_node():
    p = ConfidencePruning(explore=0.0)
    assert p.threshold(1, 50.0) == 0.0  # no cost fit yet: keep everything
    p.costs[1] = NodeCost()
    for i in range(50):
        p.costs[1].observe(i % 8, 0.030 + 0.002 * (i % 8))
    assert p.threshold(1, 50.0) == pytest.approx(0.1)
    assert p.threshold(4, 50.0) == 0.0  # each batch size has its own fit
    assert ConfidencePruning(enabled=False).plan(1, 50.0, 7) == Cut()
    assert p.plan(1, 50.0, 7).threshold == pytest.approx(0.1) and p.plan(1, 50.0, 7).keep is None


def test_exploring_steps_keep_a_random_number_of_the_best_nodes():
    p = ConfidencePruning(explore=1.0)
    p.costs[1] = NodeCost()
    for i in range(50):
        p.costs[1].observe(i % 8, 0.030 + 0.002 * (i % 8))
    keeps = {p.plan(1, 50.0, 7).keep for _ in range(200)}
    assert keeps == set(range(8))
    cold = ConfidencePruning(explore=0.0)  # before the cost fit has data, every step explores
    assert {cold.plan(1, 50.0, 7).keep for _ in range(200)} == set(range(1, 8))  # never an empty tree
    assert {cold.plan(1, 50.0, 1) for _ in range(20)} == {Cut()}  # one node: never cut at random
    for i in range(10):
        cold.observe(1, [DraftCandidates.empty()], [[]], 0.03)
        cold.costs[1].observe(i % 8, 0.03 + 0.002 * (i % 8))
    assert cold.plan(1, 50.0, 7).keep is None
    assert p.prune(_tree(), Cut(keep=2)).tokens.tolist() == [10, 11]


def test_exploring_steps_draft_below_the_floor_so_its_bins_keep_learning():
    # a draft whose low scores are accepted anyway (a self-draft: the target quantized, confident
    # in its argmax but flat in its probabilities): pruning's floor stops drafting at the bins the
    # prior rates low, so only exploring steps can show the calibration those nodes pay
    p = ConfidencePruning(explore=1.0)
    p.costs[1] = NodeCost()
    for i in range(50):
        p.costs[1].observe(i % 8, 0.030 + 0.004 * (i % 8))
    exploring = p.plan(1, 50.0, 7)
    assert exploring.keep is not None and exploring.threshold == pytest.approx(0.2)
    assert p.score_floor(exploring) == -math.inf
    steady = Cut(threshold=0.2)
    assert p.score_floor(steady) == pytest.approx(math.log(0.2))  # the prior's lowest passing bin: 0.2-0.3
    for _ in range(200):  # what exploring steps verify below the floor, at every depth: accepted
        for prob in (0.05, 0.08, 0.12, 0.17):
            p.calibration.observe(math.log(prob), True)
    assert p.score_floor(steady) <= math.log(0.05)  # the floor moved down: steady steps now draft those nodes too


def _tree():
    # a(0.8) -> b(0.42) -> c(0.11); a sibling x(0.05) of a; d(0.33) under a
    return DraftCandidates(torch.tensor([10, 11, 12, 99, 13]), torch.tensor([-1, 0, 1, -1, 0]), torch.log(torch.tensor([0.8, 0.42, 0.11, 0.05, 0.33])))


def test_prune_keeps_the_best_nodes_down_to_the_first_below_threshold():
    p = ConfidencePruning()
    kept = p.prune(_tree(), Cut(threshold=0.3))  # prior calibration: bin midpoints 0.85, 0.45, 0.35 pass, 0.125 fails
    assert kept.tokens.tolist() == [10, 11, 13]
    assert kept.parents.tolist() == [-1, 0, 0]
    assert p.prune(_tree(), Cut()).tokens.tolist() == [10, 11, 12, 99, 13]
    assert len(p.prune(_tree(), Cut(threshold=0.99))) == 0
    assert (p.kept_nodes, p.pruned_nodes) == (3 + 0, 2 + 5)


def test_observe_labels_the_accepted_path_and_feeds_the_cost_fit():
    p = ConfidencePruning()
    for _ in range(100):  # the target always accepts a, b and never the others
        p.observe(1, [_tree()], [[10, 11]], 0.04)
    cal = p.calibration
    assert cal.prob(math.log(0.8)) > 0.95 and cal.prob(math.log(0.42)) > 0.95
    assert cal.prob(math.log(0.33)) < 0.05 and cal.prob(math.log(0.11)) < 0.05
    assert p.costs[1].w > 0


class _Req:
    def __init__(self, seq_len: int = 5):
        from specfw.sampling import SamplingParams

        self.params = SamplingParams(temperature=0)
        self.seq_len = seq_len


def _beam(score_floor):
    from specfw.kv_cache import SlotAllocator
    from specfw.speculative.beam import beam_search

    vocab = 8
    first = torch.full((1, vocab), -10.0)
    first[0, 3] = 5.0  # one confident first token (p ~ 0.99)
    calls = []

    def step(chunks, parent_hidden):
        calls.append(sum(int(c[0].numel()) for c in chunks))
        n = sum(int(c[0].numel()) for c in chunks)
        return torch.zeros(n, vocab), None  # then uniform: every child has p = 1/8 of its parent

    alloc = SlotAllocator(64)
    out = beam_search(
        [_Req()], first, None, topk=2, num_steps=5, committed_slots=lambda r: torch.arange(0), allocator=alloc, step=step, score_floor=score_floor
    )
    assert alloc.num_used == 0
    return out[0], calls


def test_beam_search_stops_expanding_beams_below_the_score_floor():
    full, calls = _beam(-math.inf)
    assert calls == [2, 2, 2, 2]  # 4 more steps of topk beams
    cut, calls = _beam(math.log(0.5))
    assert calls == [1]  # only the confident beam is expanded, once
    assert cut.tokens[:2].tolist() == full.tokens[:2].tolist()
    assert len(cut) == 2 + 2  # the first level, then the confident beam's children


def _random_beam(keep, seed):
    from specfw.kv_cache import SlotAllocator
    from specfw.speculative.beam import beam_search

    vocab, calls = 16, []

    def node_logits(token, position):  # a function of the node, not of how many were forwarded
        return torch.randn(vocab, generator=torch.Generator().manual_seed(seed * 10_000 + position * 100 + token)) * 3

    def step(chunks, parent_hidden):
        calls.append(sum(int(c[0].numel()) for c in chunks))
        return torch.stack([node_logits(int(t), int(p)) for c in chunks for t, p in zip(c[0], c[1])]), None

    first = node_logits(99, 0)[None]
    out = beam_search([_Req()], first, None, topk=4, num_steps=5, committed_slots=lambda r: torch.arange(0), allocator=SlotAllocator(128), step=step, keep=keep)
    return out[0], calls


def test_beam_search_skips_beams_that_cannot_reach_the_kept_candidates():
    """A beam below the keep-th best candidate so far adds no kept node: the best ``keep``
    candidates are the same with and without skipping it, with fewer head forwards."""
    saved = 0
    for seed in range(20):
        full, full_calls = _random_beam(None, seed)
        cut, cut_calls = _random_beam(7, seed)
        kept_full, kept_cut = full.best(7), cut.best(7)
        assert sorted(zip(kept_full.tokens.tolist(), kept_full.scores.tolist())) == sorted(zip(kept_cut.tokens.tolist(), kept_cut.scores.tolist()))
        assert sum(cut_calls) <= sum(full_calls)
        saved += sum(full_calls) - sum(cut_calls)
    assert saved > 0


def test_beam_search_over_a_batch_equals_each_request_alone():
    """Greedy drafts read every request's top k back in one copy per depth: the candidates of
    each request are those of a search over that request alone (its own logits, its own keep)."""
    from specfw.kv_cache import SlotAllocator
    from specfw.speculative.beam import beam_search

    vocab = 16

    def node_logits(token, position):  # positions differ per request (their seq_len), so do the logits
        return torch.randn(vocab, generator=torch.Generator().manual_seed(position * 100 + token)) * 3

    def step(chunks, parent_hidden):
        return torch.stack([node_logits(int(t), int(p)) for c in chunks for t, p in zip(c[0], c[1])]), None

    def search(reqs):
        first = torch.stack([node_logits(99, r.seq_len) for r in reqs])
        kw = dict(topk=4, num_steps=5, committed_slots=lambda r: torch.arange(0), allocator=SlotAllocator(256), step=step, keep=7)
        return beam_search(reqs, first, None, **kw)

    reqs = [_Req(5), _Req(40), _Req(90)]
    batch = search(reqs)
    for r, got in zip(reqs, batch):
        alone = search([r])[0]
        assert got.tokens.tolist() == alone.tokens.tolist() and got.parents.tolist() == alone.parents.tolist()
        assert torch.equal(got.scores, alone.scores)
    assert len({tuple(c.tokens.tolist()) for c in batch}) == 3


@pytest.mark.model
def test_greedy_equals_plain_with_pruning_active_on_the_demo_eagle3_draft():
    from conftest import make_cfg
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw_plugins.eagle3.config import Eagle3Config

    params = SamplingParams(max_new_tokens=40, temperature=0)
    plain = Engine(make_cfg(model_dtype="bfloat16", max_total_tokens=4096, max_running_requests=3))
    prompts = [plain.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(3)]
    ref = [plain.generate([p], params)[0].token_ids for p in prompts]
    eng = Engine(make_cfg(model_dtype="bfloat16", max_total_tokens=4096, max_running_requests=3, speculative=Eagle3Config(algorithm="eagle3")))
    w = eng.worker
    w.budget.choose = lambda batch, explore=True: w.budget.max_size
    w.pruning.plan = lambda batch, rate, n: Cut(threshold=0.3)  # a high threshold: most trees are cut, most beams stop early
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert w.pruning.pruned_nodes > 0 and w.pruning.kept_nodes > 0
    assert eng.stats.accepted_draft_tokens > 0
    assert eng.scheduler.kv_in_use == 0 and w.runtime.kv.allocator.num_used == w.runtime.pair_cache.idle_slots  # the rest kept for later requests
