"""The prefix cache in the engine: a hit gives the tokens a fresh prefill gives (fp32 and bf16,
plain and every speculative algorithm), under KV pressure the cache is evicted before any request
is retracted and nothing leaks, and ``engine.disable_radix_cache`` turns it off."""

import pytest

from conftest import make_cfg
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
BASE = [100 + (7 * j) % 50 for j in range(30)]


def _conversation(eng, base=BASE, rounds=3):
    """Requests one after another, each sharing a prefix with earlier ones: a follow-up turn (an
    earlier prompt + its answer + more), a sibling (an earlier prompt's first half + other
    tokens) and a repeat. Returns every output and each request's meta (``cached_tokens``...)."""
    assert eng.flush_cache()
    outs, metas, prompt = [], [], list(base)
    for i in range(rounds):
        batch = [prompt, prompt[: len(prompt) // 2] + [300 + i, 301, 302], list(prompt)]
        got = eng.generate(batch, GREEDY)
        outs += [o.token_ids for o in got]
        metas += [o.meta for o in got]
        prompt = prompt + got[0].token_ids + [400 + i, 401]
    return outs, metas


def _fresh(eng, base=BASE, rounds=3):
    """The same requests, one at a time, the cache emptied before each: no hit anywhere."""
    outs, prompt = [], list(base)
    for i in range(rounds):
        first = None
        for p in [prompt, prompt[: len(prompt) // 2] + [300 + i, 301, 302], list(prompt)]:
            assert eng.flush_cache()
            o = eng.generate([p], GREEDY)[0]
            assert o.meta["cached_tokens"] == 0
            outs.append(o.token_ids)
            first = first or o.token_ids
        prompt = prompt + first + [400 + i, 401]
    return outs


def _check_idle(eng):
    from specfw.draft_kv import draft_kv_in_use

    cache = eng.scheduler.cache
    assert not eng.has_work and eng.scheduler.kv_in_use == 0 and draft_kv_in_use(eng) == 0
    assert eng.runner.allocator.num_used == cache.size == cache.evictable  # every kept slot is the cache's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cache_hit_gives_the_tokens_of_a_fresh_prefill(dtype, tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype=dtype, max_running_requests=3, max_total_tokens=4096))
    ref = _fresh(eng)
    computed = eng.scheduler.prefill_computed_tokens
    got, metas = _conversation(eng)
    cached = [m["cached_tokens"] for m in metas]
    assert got == ref
    # round 1: the three prompts prefill together (the cache was flushed): no hit; later rounds hit
    # the follow-up's whole earlier context, the sibling its shared half, the repeat its prompt
    assert cached[:3] == [0, 0, 0] and all(c > 0 for c in cached[3:])
    assert cached[3] >= len(BASE) + GREEDY.max_new_tokens - 1
    assert sum(cached) > eng.scheduler.prefill_computed_tokens - computed  # most prompt tokens came from the cache
    assert 0 < eng.scheduler.cache_hit_rate < 1
    _check_idle(eng)


@pytest.mark.parametrize("name", sorted(plugin_manager().algorithms))
def test_speculative_decoding_from_a_cached_prefix_equals_plain(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, tiny_spec_prompts):
    """The drafter of a request whose prefix came from the cache has no target features for that
    prefix (the EAGLE family starts its pairs where the target's prefill did): output stays plain
    greedy's, and drafting still works there (draft tokens accepted in requests that hit)."""
    from specfw.engine import Engine

    algo = plugin_manager().algorithms[name]
    extra = {}
    if name == "standalone":
        extra = {"draft_model_path": str(tiny_draft_dir)}
    elif name in tiny_eagle_drafts:
        extra = {"draft_model_path": str(tiny_eagle_drafts[name])}
        if name == "eagle3":
            extra["aux_layers"] = [0, 1, 1]
    plain = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=3, max_total_tokens=4096))
    # drafting every step: the subject is the drafter from a cached prefix, not whether the
    # policy finds drafting worth its cost on the tiny model
    spec = Engine(
        make_cfg(
            model_path=str(tiny_model_dir),
            max_running_requests=3,
            max_total_tokens=4096,
            speculative=algo.config_class(algorithm=name, adaptive_draft="false", **extra),
        )
    )
    base = tiny_spec_prompts[0]  # the tiny drafts were trained on its answer
    ref = _fresh(plain, base)
    got, metas = _conversation(spec, base)
    assert got == ref
    assert sum(m["cached_tokens"] > 0 for m in metas) >= 6
    # the prompt the draft knows the answer to, again: all but its last token come from the cache
    # (the EAGLE family's head pairs from its own pair cache), and its drafts are accepted
    rt, starts = spec.worker.runtime, []
    if hasattr(rt, "pair_cache"):  # the EAGLE family: record where each request's head pairs start
        start = rt._start

        def record(r):
            st = start(r)
            starts.append((r.num_cached, st.base, len(st.slots)))
            return st

        rt._start = record
    first, again = spec.generate([base], GREEDY)[0], spec.generate([base], GREEDY)[0]
    assert again.token_ids == first.token_ids == ref[0]
    assert again.meta["cached_tokens"] == len(base) - 1 and again.meta["spec_accept_length"] > 1
    if getattr(rt, "pair_cache", None) is not None:  # the head's own pairs of the prompt came from its pair cache
        assert starts[-1] == (len(base) - 1, 0, len(base) - 1)
    elif hasattr(rt, "pair_cache"):  # multi-layer MTP: its pairs start after the cached prefix
        assert starts[-1][1] == starts[-1][0]
    # a next turn: the target reuses its cached prefix as far as the head's cached pairs reach (the
    # last step's few tokens had no pairs yet: the target recomputes them), the head continues
    follow = base + again.token_ids + [410, 411]  # not a turn the conversation above had
    got = spec.generate([follow], GREEDY)[0]
    assert got.token_ids == plain.generate([follow], GREEDY)[0].token_ids
    if getattr(rt, "pair_cache", None) is not None:
        p0, b, n = starts[-1]
        assert len(base) <= p0 <= len(base) + len(again.token_ids) - 1 and (b, n) == (0, p0) and got.meta["cached_tokens"] == p0
    _check_idle(spec)


def test_kv_pressure_evicts_the_cache_first_and_leaks_nothing(tiny_model_dir):
    """A pool that holds about two requests: cached prefixes are evicted (least recently used
    first) to admit and grow requests; outputs equal a roomy engine's, nothing leaks."""
    from specfw.engine import Engine

    prompts = [[100 + 5 * i + j for j in range(24)] for i in range(6)] + [[100 + j for j in range(24)] + [7, 8, 9]]
    roomy = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=2, max_total_tokens=4096, disable_radix_cache=True))
    ref = [o.token_ids for o in roomy.generate(prompts, GREEDY)]
    small = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=2, max_total_tokens=100))
    for _ in range(2):
        assert [o.token_ids for o in small.generate(prompts, GREEDY)] == ref
        _check_idle(small)
    assert small.scheduler.cache.size <= 100 and small.scheduler.num_retracted == 0
    # a prompt after everything else: its earlier copy may or may not still be cached; either way
    # it is answered as before
    assert small.generate([prompts[0]], GREEDY)[0].token_ids == ref[0]


def test_disable_radix_cache_keeps_no_kv_after_a_request(tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_radix_cache=True))
    a = eng.generate([BASE], GREEDY)[0]
    b = eng.generate([BASE], GREEDY)[0]
    assert a.token_ids == b.token_ids and "cached_tokens" not in b.meta
    assert eng.scheduler.cache is None and eng.runner.allocator.num_used == 0 and eng.scheduler.cache_hit_rate == 0


def test_flush_cache_frees_every_cached_slot_only_when_idle(tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096))
    eng.generate([BASE], GREEDY)
    assert eng.runner.allocator.num_used == len(BASE) + GREEDY.max_new_tokens - 1
    eng.add_request(eng.make_request(BASE, GREEDY))
    eng.step()  # the repeat's prefill: it holds the cached prefix now
    assert not eng.flush_cache() and eng.scheduler.cache.size > 0
    while eng.has_work:
        eng.step()
    assert eng.flush_cache() and eng.runner.allocator.num_used == 0 and eng.scheduler.cache.size == 0
