"""Decode steps the draft policy plays without a draft: for greedy requests the speculative worker
runs the plain worker's one-row forward and argmax (no tree, no verify hook), still tells the
drafter what was kept, and the output stays plain greedy output; sampled requests keep the
verify path (their sampling is the verify hook's)."""

import pytest

from conftest import make_cfg
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams
from specfw.speculative.types import StepPlan

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_model_dir, tiny_spec_prompts):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype="float32", max_total_tokens=4096))
    return [o.token_ids for o in eng.generate(tiny_spec_prompts, GREEDY)]


def _engine(tiny_model_dir, tiny_eagle_drafts):
    from specfw.engine import Engine

    spec = (
        plugin_manager()
        .algorithms["eagle3"]
        .config_class(algorithm="eagle3", draft_model_path=str(tiny_eagle_drafts["eagle3"]), aux_layers=[0, 1, 1], num_steps=3, topk=2, num_draft_tokens=6)
    )
    spec.validate()
    eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype="float32", max_total_tokens=4096, max_running_requests=4, speculative=spec))
    worker, calls = eng.worker, {"plain": 0, "verify": 0, "draft": 0}
    turn = iter(range(10**6))
    worker.policy.plan = lambda batch: StepPlan(size=6, depth=3) if next(turn) % 3 == 2 else StepPlan(size=1, depth=0)  # 2 plain, 1 drafted
    for name, method in (("plain", "_plain_step"), ("verify", "_verify"), ("draft", "_draft")):
        inner = getattr(worker, method)

        def counted(*a, _inner=inner, _name=name):
            calls[_name] += 1
            return _inner(*a)

        setattr(worker, method, counted)
    return eng, calls


def test_plain_steps_of_greedy_requests_skip_the_tree_and_keep_the_output(tiny_model_dir, tiny_eagle_drafts, tiny_spec_prompts, plain):
    eng, calls = _engine(tiny_model_dir, tiny_eagle_drafts)
    got = [o.token_ids for o in eng.generate(tiny_spec_prompts, GREEDY)]
    assert got == plain
    assert calls["plain"] > 0 and calls["verify"] == calls["draft"] > 0  # plain steps never built a tree
    assert eng.worker.runtime.states == {}  # per-request drafter state released


def test_the_drafter_catches_up_on_tokens_of_plain_steps(tiny_model_dir, tiny_eagle_drafts, tiny_spec_prompts):
    """After plain steps the head's extend pass covers every token they produced (its KV length
    reaches the root), so a drafted step drafts from the current position."""
    eng, _ = _engine(tiny_model_dir, tiny_eagle_drafts)
    drafter = eng.worker.runtime
    seen = []
    inner = drafter._extend

    def extend(reqs):
        out = inner(reqs)
        seen.extend((len(drafter.states[r.rid].slots), r.seq_len - 1) for r in reqs)
        return out

    drafter._extend = extend
    eng.generate(tiny_spec_prompts[:2], GREEDY)
    assert seen and all(have == want for have, want in seen)


def test_sampled_requests_keep_the_verify_path_on_plain_steps(tiny_model_dir, tiny_eagle_drafts, tiny_spec_prompts):
    eng, calls = _engine(tiny_model_dir, tiny_eagle_drafts)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
    outs = eng.generate(tiny_spec_prompts[:2], sampled)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert calls["plain"] == 0 and calls["verify"] >= 6  # every decode step, plain ones included
