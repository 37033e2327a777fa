"""``Engine.flush_cache`` (``specfw_flush_cache``, SGLang's ``/flush_cache``): the n-gram trie
forgets earlier requests' tokens, so a request drafts as on a fresh engine; refused while
requests are in flight."""

from conftest import make_cfg
from specfw.engine import Engine
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
PROMPT = [11, 42, 7, 300, 5, 99, 1234, 8, 77, 5000, 13, 21]


def _accepted(eng: Engine, spec_cfg) -> tuple[int, int, list[int]]:
    """(verify forwards, accepted draft tokens, output) of one run of PROMPT."""
    v, a = eng.stats.verify_forwards, eng.stats.accepted_draft_tokens
    out = eng.generate([PROMPT], PARAMS)[0].token_ids
    return eng.stats.verify_forwards - v, eng.stats.accepted_draft_tokens - a, out


def test_flush_cache_makes_ngram_draft_as_on_a_fresh_engine(tiny_model_dir):
    spec = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram", adaptive_draft="false")
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative=spec)) as eng:
        first = _accepted(eng, spec)
        again = _accepted(eng, spec)  # the trie holds the first run's output: the whole answer matches
        assert eng.flush_cache()
        assert len(eng.worker.runtime.cache.trie) == 0
        flushed = _accepted(eng, spec)
    assert again[2] == first[2] == flushed[2]
    assert again[0] < first[0] and again[1] >= first[1]  # fewer verify forwards for at least as many accepted tokens
    assert flushed[:2] == first[:2]  # as on the fresh engine: same steps, same accepted tokens


def test_flush_cache_is_refused_while_requests_are_in_flight(tiny_model_dir):
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024)) as eng:
        eng.add_request(eng.make_request(PROMPT, PARAMS))
        assert not eng.flush_cache()  # plain decoding too: nothing flushed mid-flight
        while eng.has_work:
            eng.step()
        assert eng.flush_cache()


def test_flush_cache_empties_the_ngram_draft_assist_and_keeps_its_calibration(tiny_model_dir, tiny_eagle_drafts):
    spec = (
        plugin_manager()
        .algorithms["eagle3"]
        .config_class(algorithm="eagle3", draft_model_path=str(tiny_eagle_drafts["eagle3"]), aux_layers=[0, 1, 1], draft_assist="ngram")
    )
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative=spec)) as eng:
        ref = eng.generate([PROMPT], PARAMS)[0].token_ids
        assist = eng.worker.assist
        assert len(assist.cache.trie) > 0
        calibration = [{k: list(v) for k, v in c.__dict__.items()} for c in assist.calibration]
        assert eng.flush_cache()
        assert len(assist.cache.trie) == 0 and not assist.cache.open
        assert [c.__dict__ for c in assist.calibration] == calibration  # acceptance rates, not tokens: kept
        assert eng.generate([PROMPT], PARAMS)[0].token_ids == ref
