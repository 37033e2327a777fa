"""Continuous batching behaviour: admission limits, queueing, retraction under KV pressure,
rejection of requests that can never run."""

import pytest

from conftest import make_cfg
from specfw.sampling import SamplingParams
from specfw.scheduler import RequestRejected

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n):
    return [[100 + 7 * i + j for j in range(6 + i)] for i in range(n)]


def test_running_limit_and_queue(tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=2, max_total_tokens=4096))
    reqs = [eng.add_request(eng.make_request(p, GREEDY)) for p in _prompts(5)]
    peak = 0
    while eng.has_work:
        eng.step()
        peak = max(peak, len(eng.scheduler.running))
        assert len(eng.scheduler.running) <= 2
    assert peak == 2 and all(len(r.output_ids) == 24 for r in reqs)


def test_batched_equals_sequential(tiny_engine):
    seq = [tiny_engine.generate([p], GREEDY)[0].token_ids for p in _prompts(6)]
    batched = [o.token_ids for o in tiny_engine.generate(_prompts(6), GREEDY)]
    assert batched == seq


def test_retraction_under_kv_pressure_keeps_outputs(tiny_model_dir, tiny_engine):
    from specfw.engine import Engine

    ref = [o.token_ids for o in tiny_engine.generate(_prompts(4), GREEDY)]
    # 4 requests x (~8 prompt + 24 new) tokens do not fit in 80 slots together
    small = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=4, max_total_tokens=80))
    outs = [o.token_ids for o in small.generate(_prompts(4), GREEDY)]
    assert small.scheduler.num_retracted > 0
    assert outs == ref
    assert small.scheduler.kv_in_use == 0


def test_admission_counts_every_prompt_of_a_prefill_batch(tiny_model_dir, tiny_engine):
    """Prompts that fit the pool one by one but not together: admission must stop short
    (once it only compared each prompt with the free slots, and the prefill ran out of slots)."""
    from specfw.engine import Engine

    prompts = [[100 + 3 * i + j for j in range(40)] for i in range(6)]
    ref = [o.token_ids for o in tiny_engine.generate(prompts, GREEDY)]
    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=6, max_total_tokens=150))
    outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert outs == ref
    assert eng.scheduler.kv_in_use == 0


def test_lone_request_larger_than_pool_ends_with_length(tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=16))
    out = eng.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and 0 < len(out.token_ids) <= 13
    assert eng.scheduler.kv_in_use == 0


def test_requests_that_can_never_run_are_rejected(tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=64, model_context_length=128))
    with pytest.raises(RequestRejected, match="KV pool holds 64"):
        eng.make_request(list(range(100)), GREEDY)
    with pytest.raises(RequestRejected, match="context length is 128"):
        eng.make_request(list(range(200)), GREEDY)
    with pytest.raises(RequestRejected, match="empty"):
        eng.make_request([], GREEDY)


def test_queue_bound(tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_queued_requests=2))
    eng.add_request(eng.make_request([1, 2, 3], GREEDY))
    eng.add_request(eng.make_request([1, 2, 3], GREEDY))
    with pytest.raises(RequestRejected, match="queue is full"):
        eng.add_request(eng.make_request([1, 2, 3], GREEDY))


def test_stop_conditions(tiny_engine):
    base = tiny_engine.generate([[11, 12, 13]], GREEDY)[0]
    stop_tok = base.token_ids[5]
    out = tiny_engine.generate([[11, 12, 13]], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    text = base.text
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    if needle.strip():
        out = tiny_engine.generate([[11, 12, 13]], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=[needle]))[0]
        assert out.finish_reason == "stop" and needle not in out.text and text.startswith(out.text)


def test_seeded_requests_reproducible_across_batches(tiny_engine):
    p = SamplingParams(max_new_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    alone = tiny_engine.generate([[40, 41, 42]], p)[0].token_ids
    mixed = tiny_engine.generate([[40, 41, 42], [7, 8, 9, 10]], [p, SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)])
    assert mixed[0].token_ids == alone
