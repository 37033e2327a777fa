"""The overlap scheduler (``engine.overlap_schedule``; core/overlap.py) on the tiny random model:
outputs one step late but the same, stop strings, streaming deltas, aborts, a failing request,
and its startup rules (SGLang's SpecV2: chains only; its env var)."""

import pytest

from conftest import make_cfg
from specfw.config import ConfigError
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams

PROMPTS = [[5 + i, 6, 7 + i, 8] for i in range(6)]
LONG = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def _engine(model_dir, overlap: bool, spec=None, **kw):
    from specfw.engine import Engine

    return Engine(make_cfg(model_path=str(model_dir), max_total_tokens=4096, max_running_requests=4, overlap_schedule=overlap, speculative=spec, **kw))


def _standalone(draft_dir, **shape):
    shape = shape or {"num_steps": 3, "topk": 1}
    return plugin_manager().algorithms["standalone"].config_class(algorithm="standalone", draft_model_path=str(draft_dir), **shape)


def _stream(eng, prompts, params):
    """Every step's outputs per request: (deltas, token ids, finished outputs)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [eng.add_request(eng.make_request(p, sp)) for p, sp in zip(prompts, plist)]
    seen = {r.rid: ([], [], []) for r in reqs}
    while eng.has_work:
        for o in eng.step():
            text, ids, fin = seen[o.rid]
            text.append(o.text_delta)
            ids.extend(o.new_token_ids)
            if o.finished:
                fin.append(o)
    return reqs, seen


QUESTIONS = ["Name three colors and say why you like them.", "Write a haiku about the sea.", "Explain what a CPU cache is.", "List four fruits."]


@pytest.mark.model
@pytest.mark.parametrize("drafted", [False, True])
def test_stop_strings_and_stream_deltas_equal_the_sequential_engine(demo_engine, drafted):
    """Demo model: a stop string ends a request one step late inside the engine; what it returns
    (text, token ids, finish reason, streamed deltas) is what the engine without overlap returns."""
    from specfw.engine import Engine

    prompts = [demo_engine.tokenize_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    free = demo_engine.generate(prompts, LONG)
    stops = [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, stop=[c.text[len(c.text) // 2 :][:3]]) for c in free]
    ref = demo_engine.generate(prompts, stops)
    assert sum(c.finish_reason == "stop" for c in ref) == len(QUESTIONS)  # every stop string is hit, mid-output
    spec = plugin_manager().algorithms["standalone"].config_class(algorithm="standalone", num_steps=3, topk=1) if drafted else None
    with Engine(make_cfg(max_running_requests=8, max_total_tokens=8192, overlap_schedule=True, speculative=spec)) as eng:
        got = eng.generate(prompts, stops)
        assert [(c.text, c.token_ids, c.finish_reason) for c in got] == [(c.text, c.token_ids, c.finish_reason) for c in ref]
        reqs, seen = _stream(eng, prompts, stops)
        for r, c in zip(reqs, ref):
            text, ids, fin = seen[r.rid]
            assert len(fin) == 1 and fin[0].finish_reason == "stop" and fin[0].completion_tokens == len(r.output_ids) == len(c.token_ids)
            assert "".join(text) == r.final_text == c.text and ids == r.output_ids
        assert eng.scheduler.kv_in_use == 0 and not eng.has_work


def test_abort_between_steps(tiny_model_dir, tiny_draft_dir):
    with _engine(tiny_model_dir, False) as ref_eng:
        ref = [c.token_ids for c in ref_eng.generate(PROMPTS, LONG)]
    with _engine(tiny_model_dir, True, _standalone(tiny_draft_dir)) as eng:
        reqs = [eng.add_request(eng.make_request(p, LONG)) for p in PROMPTS]
        finished = {}
        for _ in range(3):
            for o in eng.step():
                finished.setdefault(o.rid, o) if o.finished else None
        aborted = eng.abort(reqs[1].rid)
        assert aborted is not None and aborted.finish_reason == "abort" and aborted.finished
        while eng.has_work:
            for o in eng.step():
                if o.finished:
                    assert o.rid not in finished
                    finished[o.rid] = o
        assert reqs[1].rid not in finished
        assert [r.output_ids for i, r in enumerate(reqs) if i != 1] == [t for i, t in enumerate(ref) if i != 1]
        assert eng.scheduler.kv_in_use == 0 and not eng.scheduler.running


def test_a_failing_request_fails_alone(tiny_model_dir, monkeypatch):
    with _engine(tiny_model_dir, False) as ref_eng:
        ref = [c.token_ids for c in ref_eng.generate(PROMPTS, LONG)]
    with _engine(tiny_model_dir, True) as eng:
        real = eng.worker.decode

        def decode(batch):
            if any(r.rid.endswith("-bad") for r in batch.reqs) and all(len(r.output_ids) >= 3 for r in batch.reqs):
                raise RuntimeError("injected failure")
            return real(batch)

        monkeypatch.setattr(eng.worker, "decode", decode)
        reqs = [eng.add_request(eng.make_request(p, LONG, rid=f"r{i}" + ("-bad" if i == 2 else ""))) for i, p in enumerate(PROMPTS)]
        outs = {}
        while eng.has_work:
            outs.update({o.rid: o for o in eng.step() if o.finished})
        assert outs["r2-bad"].finish_reason == "error" and "injected failure" in outs["r2-bad"].error
        assert [r.output_ids for i, r in enumerate(reqs) if i != 2] == [t for i, t in enumerate(ref) if i != 2]
        assert eng.stats.step_failures >= 2 and eng.scheduler.kv_in_use == 0


# ---- startup rules ------------------------------------------------------------------------------
def test_rules_name_the_key(tiny_model_dir, tiny_draft_dir):
    from specfw.config import validate

    with pytest.raises(ConfigError, match=r"speculative\.topk.*allowed 1, got 4"):
        tree = _standalone(tiny_draft_dir, num_steps=3, topk=4, num_draft_tokens=8)
        validate(make_cfg(model_path=str(tiny_model_dir), overlap_schedule=True, speculative=tree))
    ngram = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram")
    with pytest.raises(ConfigError, match=r"engine\.overlap_schedule.*ngram"):
        validate(make_cfg(model_path=str(tiny_model_dir), overlap_schedule=True, speculative=ngram))
    with pytest.raises(ConfigError, match=r"engine\.overlap_schedule.*tp_size"):
        validate(make_cfg(model_path=str(tiny_model_dir), model_tp_size=2, overlap_schedule=True))
    with pytest.raises(ConfigError, match=r"speculative\.draft_assist.*makes a tree; allowed: null"):
        chain = _standalone(tiny_draft_dir, num_steps=3, topk=1, draft_assist="ngram")
        validate(make_cfg(model_path=str(tiny_model_dir), overlap_schedule=True, speculative=chain))


def test_sglang_env_var_turns_it_on_for_chains_only(tiny_model_dir, tiny_draft_dir, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "True")
    auto = _standalone(tiny_draft_dir, num_steps=None, topk=None, num_draft_tokens=None)
    with _engine(tiny_model_dir, False, auto) as eng:  # no tree key given: the auto depth as a topk=1 chain
        assert eng.overlap is not None and eng.tree_shape.topk == 1 and eng.tree_shape.num_draft_tokens == eng.tree_shape.num_steps + 1
    with _engine(tiny_model_dir, False) as eng:  # plain decoding: SpecV2 is about speculative workers
        assert eng.overlap is None
    ngram = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram")
    with _engine(tiny_model_dir, False, ngram) as eng:
        assert eng.overlap is None
    assert "drafts trees: the overlap scheduler stays off" in caplog.text


def test_served_streams_equal_the_sequential_engine(tiny_model_dir, tiny_draft_dir):
    """A real uvicorn server with the overlap scheduler, 4 concurrent streamed completions through
    the openai client (a standalone chain): each stream's text and usage equal the engine's without
    overlap, and the server ends idle."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from server_helpers import ServerThread, engine_idle
    from specfw.server.app import create_app

    prompts = [[1000 + 7 * i, 20, 1000, 20 + i] for i in range(4)]
    with _engine(tiny_model_dir, False) as ref_eng:
        ref = ref_eng.generate(prompts, LONG)
    eng = _engine(tiny_model_dir, True, _standalone(tiny_draft_dir))
    with ServerThread(create_app(eng)) as server:
        server.engine = eng
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def stream(p):
            chunks = client.completions.create(model="default", prompt=p, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(stream, prompts))
        assert texts == [c.text for c in ref]
        assert engine_idle(server) and eng.stats.verify_forwards > 0
    eng.close()


def test_deliver_streams_the_last_step_from_the_output_thread(tiny_model_dir):
    """``Engine.step(deliver=...)``: step N-1's outputs reach ``deliver`` on the output thread while
    step N computes; together with what ``step`` returns they are every output, once, in order."""
    import threading

    with _engine(tiny_model_dir, False) as ref_eng:
        ref = [c.token_ids for c in ref_eng.generate(PROMPTS, LONG)]
    with _engine(tiny_model_dir, True) as eng:
        reqs = [eng.add_request(eng.make_request(p, LONG)) for p in PROMPTS]
        seen, threads, finished = {r.rid: [] for r in reqs}, set(), []

        def take(outs):
            for o in outs:
                seen[o.rid].extend(o.new_token_ids)
                finished.extend([o.rid] if o.finished else [])

        def deliver(outs):
            threads.add(threading.current_thread().name)
            take(outs)

        while eng.has_work:
            take(eng.step(deliver=deliver))
        assert threads and all(t.startswith("specfw-outputs") for t in threads)
        assert [seen[r.rid] for r in reqs] == ref and sorted(finished) == sorted(r.rid for r in reqs)
