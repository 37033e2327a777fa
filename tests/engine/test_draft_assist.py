"""``speculative.draft_assist``: greedy output stays plain greedy output with an assist merged into
every model-based drafter's tree, whatever the assist proposes (an oracle's right tokens are
accepted, an adversary's wrong ones cost nothing but their verification)."""

import pytest

from conftest import make_cfg
from specfw import hookspecs
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams
from specfw.speculative.types import DraftCandidates

GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
MODEL_DRAFTERS = ["eagle", "eagle3", "mtp", "standalone"]


@pytest.fixture(scope="module")
def prompts(tiny_spec_prompts):
    return tiny_spec_prompts


@pytest.fixture(scope="module")
def plain(tiny_model_dir, prompts):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype="float32", max_total_tokens=4096))
    return [o.token_ids for o in eng.generate(prompts, GREEDY)]


def spec_config(name, tiny_draft_dir, drafts, **kw):
    extra = {"draft_model_path": str(tiny_draft_dir)} if name == "standalone" else {"draft_model_path": str(drafts[name])}
    if name == "eagle3":
        extra["aux_layers"] = [0, 1, 1]
    cfg = plugin_manager().algorithms[name].config_class(algorithm=name, **extra, **kw)
    cfg.validate()
    return cfg


def run(tiny_model_dir, spec, prompts):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype="float32", max_total_tokens=4096, max_running_requests=4, speculative=spec))
    single = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    return eng, single, batched


@pytest.mark.parametrize("name", MODEL_DRAFTERS)
def test_ngram_assist_keeps_greedy_output(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, plain):
    spec = spec_config(name, tiny_draft_dir, tiny_eagle_drafts, num_steps=3, topk=2, num_draft_tokens=8, draft_assist="ngram")
    eng, single, batched = run(tiny_model_dir, spec, prompts)
    assert single == plain, f"{name} + ngram assist: batch 1 diverged"
    assert batched == plain, f"{name} + ngram assist: batch 4 diverged"
    assert eng.scheduler.kv_in_use == 0
    calib = eng.worker.assist.calibration  # one per matched-suffix length bucket
    assert sum(c.tried[0] for c in calib if c.tried) > 0, "the assist never proposed a chain that was judged"
    assert sum(c.right[0] for c in calib if c.right) > 0, "the assist's chains were never right on these repetitive prompts"
    assert not eng.worker.assist.proposed and not eng.worker.assist.cache.open  # released with the requests
    # one-request steps timed the drafter's hook inside the step: what the assist's skip rule weighs
    tokens, step, draft = eng.worker.policy.drafter_steps
    assert tokens >= 1 and 0 < draft < step


class _ScriptedAssist:
    """Proposes, for a request whose tokens are a prefix of a reference sequence, the reference's
    next tokens (oracle) or each of them plus one (adversary), scored above any log-probability
    (a drafter's head may be sure of its tokens: log-probability 0)."""

    references: list[list[int]] = []
    wrong = False

    def __init__(self, ctx):
        pass

    @hookspecs.hookimpl
    def specfw_assist_draft(self, ctx, reqs, plan):
        out = []
        for r in reqs:
            seq = r.seq_ids
            full = next((f for f in self.references if f[: len(seq)] == seq), None)
            chain = full[len(seq) : len(seq) + plan.size - 1] if full else []
            if self.wrong:
                chain = [(t + 1) % 1000 for t in chain]
            out.append(DraftCandidates.chain(chain) if chain else DraftCandidates.empty())
            if chain:
                out[-1].scores.fill_(1.0)
        return out


class _Oracle(_ScriptedAssist):
    pass


class _Adversary(_ScriptedAssist):
    wrong = True


class _ScriptedPlugin:
    @hookspecs.hookimpl
    def specfw_register_draft_assists(self, register):
        register("test-oracle", _Oracle, "test")
        register("test-adversary", _Adversary, "test")


@pytest.fixture
def scripted_assists(prompts, plain):
    refs = [list(p) + list(o) for p, o in zip(prompts, plain)]
    _ScriptedAssist.references = refs
    pm = plugin_manager()
    pm.register(_ScriptedPlugin(), "test-scripted-assists")
    yield
    pm.unregister("test-scripted-assists")


def test_an_oracle_assist_is_accepted_and_an_adversary_changes_nothing(
    scripted_assists, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, plain, monkeypatch
):
    from specfw_plugins.eagle3.drafter import Eagle3Drafter

    drafted = []  # requests the EAGLE-3 head drafted for, per call
    head_draft = Eagle3Drafter.specfw_draft

    def counting(self, ctx, reqs, plan):
        drafted.append(len(reqs))
        return head_draft(self, ctx, reqs, plan)

    monkeypatch.setattr(Eagle3Drafter, "specfw_draft", hookspecs.hookimpl(counting))
    shape = dict(num_steps=3, topk=1, adaptive_draft="false")  # chains of 3 every step
    eng, single, batched = run(tiny_model_dir, spec_config("eagle3", tiny_draft_dir, tiny_eagle_drafts, draft_assist="test-oracle", **shape), prompts)
    assert single == plain and batched == plain
    # every drafted step verifies the oracle's 3 tokens and accepts them (fewer only at a request's end)
    assert eng.stats.accepted_draft_tokens >= 0.9 * 3 * eng.stats.verify_forwards
    # and once a few steps have shown what a step accepts, the oracle's sure chain makes the head's forward unnecessary
    assert 0 < sum(drafted) < 0.2 * eng.stats.verify_forwards

    eng, single, batched = run(tiny_model_dir, spec_config("eagle3", tiny_draft_dir, tiny_eagle_drafts, draft_assist="test-adversary", **shape), prompts)
    assert single == plain and batched == plain
    plain_eng, _, _ = run(tiny_model_dir, spec_config("eagle3", tiny_draft_dir, tiny_eagle_drafts, **shape), prompts)
    # the adversary's chain outranks the head's, so the head's tokens are rarely verified
    assert eng.stats.accepted_draft_tokens < plain_eng.stats.accepted_draft_tokens


def test_an_assist_may_not_draft_itself(tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts):
    from specfw.engine import Engine

    class Greedy:
        def __init__(self, ctx):
            pass

        @hookspecs.hookimpl
        def specfw_draft(self, ctx, reqs):
            return [DraftCandidates.empty() for _ in reqs]

        @hookspecs.hookimpl
        def specfw_assist_draft(self, ctx, reqs, plan):
            return [DraftCandidates.empty() for _ in reqs]

    class Plugin:
        @hookspecs.hookimpl
        def specfw_register_draft_assists(self, register):
            register("test-greedy", lambda ctx: Greedy(ctx))

    pm = plugin_manager()
    pm.register(Plugin(), "test-greedy-assist")
    try:
        spec = spec_config("eagle3", tiny_draft_dir, tiny_eagle_drafts, draft_assist="test-greedy")
        with pytest.raises(RuntimeError, match="draft assist 'test-greedy' implements specfw_draft"):
            Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype="float32", max_total_tokens=4096, speculative=spec))
    finally:
        pm.unregister("test-greedy-assist")
