"""Verification: greedy walk, and distribution preservation of stochastic tree verification
(thresholds 1.0) and chain rejection sampling."""

import pytest
import torch

from specfw.request import Request
from specfw.sampling import SamplingParams, target_probs
from specfw.speculative.tree import build_tree
from specfw.speculative.types import DraftCandidates
from specfw.speculative.verify import verify, verify_greedy


def _tree():
    # root(0) → 1:tok 3, 2:tok 5 ; 1 → 3:tok 4
    return build_tree(0, DraftCandidates(torch.tensor([3, 5, 4]), torch.tensor([-1, -1, 0]), torch.tensor([-0.1, -0.2, -0.3])), 4)


def test_greedy_walk_and_bonus():
    logits = torch.full((4, 8), -5.0)
    logits[0, 5] = 5  # target after root: 5 → second child accepted
    logits[2, 7] = 5  # after node 2: 7 → bonus
    r = verify_greedy(_tree(), logits)
    assert r.accepted_nodes == [0, 2] and r.tokens == [5, 7] and r.num_accepted == 1
    logits[0, 5], logits[0, 3] = -5, 5  # now first child, then its child 4
    logits[1, 4] = 5
    logits[3, 6] = 5
    r = verify_greedy(_tree(), logits)
    assert r.accepted_nodes == [0, 1, 3] and r.tokens == [3, 4, 6]
    logits[0, 3], logits[0, 1] = -5, 5  # no child matches: bonus only
    r = verify_greedy(_tree(), logits)
    assert r.accepted_nodes == [0] and r.tokens == [1]


def _first_token_histogram(make_tree, logits, params, n):
    counts = torch.zeros(logits.shape[-1])
    req = Request(prompt_ids=[1], params=params)
    for _ in range(n):
        res = verify(req, make_tree(), logits)
        counts[res.tokens[0]] += 1
    return counts / n


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_sampling_with_unit_thresholds_preserves_target(temperature):
    torch.manual_seed(0)
    V = 6
    logits = torch.randn(4, V) * 1.5
    params = SamplingParams(temperature=temperature, seed=1234)
    p = target_probs(logits[:1], params)[0]
    emp = _first_token_histogram(_tree, logits, params, 20000)
    assert (emp - p).abs().max() < 0.015, (emp, p)


def test_low_thresholds_accept_more():
    torch.manual_seed(0)
    logits = torch.randn(4, 6)
    params = SamplingParams(temperature=1.0, seed=3)
    req = Request(prompt_ids=[1], params=params)
    lossless = sum(verify(req, _tree(), logits).num_accepted for _ in range(3000))
    req = Request(prompt_ids=[1], params=params)
    eager = sum(verify(req, _tree(), logits, threshold_single=0.05, threshold_acc=0.3).num_accepted for _ in range(3000))
    assert eager > lossless


def test_chain_rejection_sampling_preserves_target():
    torch.manual_seed(1)
    V = 5
    q = torch.softmax(torch.randn(2, V), -1)  # draft distributions of the two chain nodes
    logits = torch.randn(3, V)
    params = SamplingParams(temperature=1.0, seed=99)
    req = Request(prompt_ids=[1], params=params)
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(V)
    n = 20000
    for _ in range(n):
        d1 = int(torch.multinomial(q[0], 1, generator=g))
        d2 = int(torch.multinomial(q[1], 1, generator=g))
        tree = build_tree(0, DraftCandidates.chain([d1, d2], draft_probs=q), 3)
        counts[verify(req, tree, logits).tokens[0]] += 1
    p = target_probs(logits[:1], params)[0]
    assert (counts / n - p).abs().max() < 0.015


def test_force_greedy_and_penalties():
    logits = torch.zeros(4, 8)
    logits[0, 3] = 2.0
    logits[0, 5] = 1.9
    sampled = Request(prompt_ids=[1], params=SamplingParams(temperature=1.0, seed=0))
    assert verify(sampled, _tree(), logits, force_greedy=True).tokens[0] == 3
    # repetition penalty on token 3 (in the prompt) makes 5 the greedy choice at the root
    pen = Request(prompt_ids=[3], params=SamplingParams(temperature=0, repetition_penalty=2.0))
    assert verify(pen, _tree(), logits).tokens[0] == 5


def test_greedy_walk_takes_argmaxes_read_already():
    """The worker reads every node's argmax of a greedy batch at once and hands each request its
    slice: the walk from those equals the walk from the logits."""
    logits = torch.full((4, 8), -5.0)
    logits[0, 3], logits[1, 4], logits[3, 6] = 5, 5, 5
    r = verify_greedy(_tree(), logits, argmax=logits.argmax(-1).tolist())
    assert (r.accepted_nodes, r.tokens) == ([0, 1, 3], [3, 4, 6])
    # the argmaxes are what is walked (the logits are not read again)
    r = verify_greedy(_tree(), logits, argmax=[5, 0, 7, 0])
    assert (r.accepted_nodes, r.tokens) == ([0, 2], [5, 7])


def test_worker_reads_a_greedy_batchs_argmaxes_once(tiny_model_dir, monkeypatch):
    """All-greedy batch: the verify hook gets each node's argmax (read once for the step); a batch
    with a sampled request: None, and the walk reads its own logits. Outputs stay plain's."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.speculative import defaults, verify as verify_mod

    seen = []

    def spy(req, tree, logits, *args):
        seen.append((args[-1], logits.argmax(-1).tolist()))
        return verify_mod.verify(req, tree, logits, *args)

    monkeypatch.setattr(defaults, "verify", spy)
    ngram = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram", adaptive_draft="false")
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8]
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    plain = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096)).generate(prompts, greedy)
    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=2, speculative=ngram))
    assert [o.token_ids for o in eng.generate(prompts, greedy)] == [o.token_ids for o in plain]
    assert seen and all(a is not None and a == best for a, best in seen)
    seen.clear()
    out = eng.generate(prompts, [greedy, SamplingParams(max_new_tokens=24, temperature=0.8, seed=1)])
    assert out[0].token_ids == plain[0].token_ids
    assert seen and all(a is None for a, _ in seen)
