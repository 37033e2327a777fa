"""Draft assists (``speculative.draft_assist``): merging an assist's tree into the drafter's, the
ngram assist's online calibration, registration and config errors."""

import math

import pytest
import torch

from specfw import hookspecs
from specfw.config import ConfigError
from specfw.plugins import PluginError, PluginManager, plugin_manager
from specfw.speculative.merge import merge_candidates
from specfw.speculative.types import DraftCandidates


def cands(tokens, parents, scores, probs=None):
    return DraftCandidates(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores, dtype=torch.float32), probs)


def test_merge_reuses_shared_paths_and_appends_new_nodes_parents_first():
    # drafter: 10 -> 11, 10 -> 12, 20 (two roots' children); assist chain 10 -> 11 -> 13
    base = cands([10, 20, 11, 12], [-1, -1, 0, 0], [-0.1, -2.0, -0.5, -0.9])
    extra = cands([10, 11, 13], [-1, 0, 1], [-0.3, -0.4, -0.6])
    m = merge_candidates(base, extra)
    assert m.tokens.tolist() == [10, 20, 11, 12, 13]
    assert m.parents.tolist() == [-1, -1, 0, 0, 2]  # 13 hangs under the drafter's 11
    assert m.scores.tolist() == pytest.approx([-0.1, -2.0, -0.4, -0.9, -0.6])  # the higher score of the two kept
    assert all(p < i for i, p in enumerate(m.parents.tolist()))
    pairs = list(zip(m.parents.tolist(), m.tokens.tolist()))
    assert len(set(pairs)) == len(pairs)  # siblings stay distinct tokens: tree sampling's inverse CDF needs it


def test_merge_keeps_draft_probs_only_when_nothing_is_added():
    probs = torch.rand(2, 5)
    base = cands([1, 2], [-1, 0], [-0.1, -0.2], probs)
    assert merge_candidates(base, cands([1], [-1], [0.0])).draft_probs is probs
    assert merge_candidates(base, cands([1, 3], [-1, 0], [0.0, -0.1])).draft_probs is None
    assert merge_candidates(base, DraftCandidates.empty()) is base
    alone = merge_candidates(DraftCandidates.empty(), cands([7, 8], [-1, 0], [-0.5, -1.0]))
    assert alone.tokens.tolist() == [7, 8] and alone.parents.tolist() == [-1, 0]


def test_merged_tree_is_cut_by_score_like_any_drafter_tree():
    base = cands([10, 11], [-1, 0], [-0.2, -3.0])
    extra = cands([10, 12, 13], [-1, 0, 1], [-0.2, -0.5, -0.7])
    best = merge_candidates(base, extra).best(3)
    assert best.tokens.tolist() == [10, 12, 13]  # the assist's chain beats the drafter's weak 11
    assert best.parents.tolist() == [-1, 0, 1]


def test_ngram_assist_calibration_counts_per_depth():
    from specfw_plugins.ngram.calibration import DepthCalibration

    c = DepthCalibration()
    assert c.log_probs(2) == pytest.approx([torch.log(torch.tensor(0.5)).item(), 2 * torch.log(torch.tensor(0.5)).item()])
    c.observe([1, 2, 3], [1, 2, 9, 4])  # right, right, wrong: depth 3 tried once, never right
    c.observe([1, 5], [1, 2])  # right, wrong
    c.observe([7, 7, 7], [1])  # wrong at depth 1; deeper ones cannot be judged
    assert c.tried == [3, 2, 1] and c.right == [2, 1, 0]
    lp = c.log_probs(4)
    expect = [3 / 5, 2 / 4, 1 / 3, 1 / 2]
    acc = 0.0
    for d, p in enumerate(expect):
        acc += torch.log(torch.tensor(p)).item()
        assert lp[d] == pytest.approx(acc)


def test_ngram_assist_calibrates_per_matched_suffix_length():
    from specfw_plugins.ngram.calibration import window_bucket

    assert [window_bucket(w) for w in (1, 2, 3, 4, 5, 8, 9, 12)] == [0, 1, 2, 2, 3, 3, 4, 4]


def test_ngram_assist_is_registered_and_listed():
    pm = PluginManager()
    assert pm.assists["ngram"].module == "specfw_plugins.ngram"


def test_config_errors_name_the_key_and_the_choices():
    eagle3 = plugin_manager().algorithms["eagle3"].config_class
    with pytest.raises(ConfigError, match=r"speculative.draft_assist: 'ngrm' is not one of \[None, .*'ngram'"):
        eagle3(algorithm="eagle3", draft_assist="ngrm").validate()
    ngram = plugin_manager().algorithms["ngram"].config_class
    with pytest.raises(ConfigError, match="speculative.draft_assist: 'ngram' is the algorithm itself"):
        ngram(algorithm="ngram", draft_assist="ngram").validate()
    eagle3(algorithm="eagle3", draft_assist="ngram").validate()


def test_assist_registration_rules():
    class Assist:
        @hookspecs.hookimpl
        def specfw_assist_draft(self, ctx, reqs, plan):
            return [DraftCandidates.empty() for _ in reqs]

    class Plugin:
        @hookspecs.hookimpl
        def specfw_register_draft_assists(self, register):
            register("mine", Assist, "test")

    pm = PluginManager(load_entry_points=False)
    pm.register(Plugin(), "p1")
    assert pm.assists["mine"].description == "test"
    with pytest.raises(PluginError, match="registered twice"):
        pm.register(Plugin(), "p2")

    class Unmarked:
        def specfw_assist_draft(self, ctx, reqs, plan):
            return []

    class Plugin2:
        @hookspecs.hookimpl
        def specfw_register_draft_assists(self, register):
            register("unmarked", Unmarked)

    with pytest.raises(PluginError, match="without the @hookimpl marker"):
        PluginManager(load_entry_points=False).register(Plugin2(), "p3")


def test_depth_calibration_judges_a_tree_along_the_targets_path():
    from specfw_plugins.ngram.calibration import DepthCalibration

    # root children 1, 2; under 1: 3, 4; under 3: 5
    tokens, parents = [1, 2, 3, 4, 5], [-1, -1, 0, 0, 2]
    c = DepthCalibration()
    c.observe_tree(tokens, parents, [1, 4, 8])  # depth 1 right, depth 2 right (a sibling), node 4 has no children: depth 3 not judged
    c.observe_tree(tokens, parents, [2, 7])  # right at depth 1; node 2 ends the tree
    c.observe_tree(tokens, parents, [1, 3, 6])  # right, right, wrong at depth 3
    c.observe_tree(tokens, parents, [9])  # wrong at depth 1 (a pruned step's bonus token is the target's own)
    assert c.tried == [4, 2, 1] and c.right == [3, 2, 0]


def test_ngram_drafter_scores_deep_nodes_by_how_often_the_target_reached_them():
    """The trie's continuation of a context is one chain (every score 0 from frequencies alone);
    once the target has shown that it follows the first token and never the second, the second
    node's score falls far below the first: confidence pruning can cut the chain after one."""
    from types import SimpleNamespace

    from specfw_plugins.ngram.config import NgramConfig
    from specfw_plugins.ngram.drafter import NgramDrafter

    drafter = NgramDrafter(SimpleNamespace(config=NgramConfig(algorithm="ngram")))
    req = SimpleNamespace(rid="r", seq_ids=[5, 6, 7, 8, 9, 5, 6])
    before = drafter._draft_one(req, 3)
    assert before.tokens.tolist() == [7, 8, 9] and before.parents.tolist() == [-1, 0, 1]
    for _ in range(20):
        drafter._draft_one(req, 3)
        drafter.specfw_on_accept(None, [req], [SimpleNamespace(tokens=[7, 1])], None, [])
    after = drafter._draft_one(req, 3).scores
    assert after[0] > math.log(0.9) and after[1] < math.log(0.1) and after[2] < after[1]
    assert before.scores[1] > after[1]
    drafter.specfw_release(None, req)
    assert not drafter.drafted
