"""Every speculative option composes; each validation rule produces its message."""

import pytest
import torch
from hydra import compose, initialize_config_module

from specfw.config import ConfigError, validate
from specfw.config_store import register_configs
from specfw.plugins import plugin_manager
from specfw.speculative.config import SpecAlgoConfig, TreeShape


def _compose(overrides):
    register_configs()
    with initialize_config_module("specfw_conf", version_base="1.3"):
        return compose("serve", overrides=overrides)


@pytest.mark.parametrize("name", ["none"] + sorted(plugin_manager().algorithms))
def test_every_option_composes(name):
    cfg = _compose([f"speculative={name}"])
    assert cfg.speculative.algorithm == name


def test_sglang_names_and_defaults():
    cfg = _compose(["speculative=ngram"])
    s = cfg.speculative
    assert (s.min_match_window_size, s.max_match_window_size, s.min_bfs_breadth, s.max_bfs_breadth) == (1, 12, 1, 10)
    assert (s.match_type.value, s.branch_length, s.capacity) == ("BFS", 18, 10_000_000)
    assert (s.accept_threshold_single, s.accept_threshold_acc, s.attention_mode.value) == (1.0, 1.0, "prefill")
    cfg = _compose(["speculative=standalone", "speculative.draft_model_path=/x", "speculative.topk=1"])
    assert cfg.speculative.draft_model_revision is None


def test_typo_in_algorithm_key_fails_naming_it():
    with pytest.raises(Exception) as e:
        _compose(["speculative=ngram", "speculative.max_bfs_bredth=3"])
    assert "max_bfs_bredth" in str(e.value) + str(e.value.__cause__)


def test_bad_enum_value_lists_choices():
    with pytest.raises(Exception) as e:
        _compose(["speculative=ngram", "speculative.match_type=DFS"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "BFS" in msg and "PROB" in msg


def _shape(**kw):
    return SpecAlgoConfig(algorithm="x", **kw).resolve_shape("LlamaForCausalLM")


def test_auto_defaults():
    assert _shape() == TreeShape(5, 4, 8)
    assert SpecAlgoConfig(algorithm="x").resolve_shape("Qwen2ForCausalLM") == TreeShape(3, 1, 4)
    from specfw_plugins.standalone.config import StandaloneConfig

    assert StandaloneConfig(algorithm="standalone").resolve_shape("LlamaForCausalLM") == TreeShape(3, 1, 4)
    # the self-draft (the target's own checkpoint, quantized) agrees ~0.97 a token: a chain of 5
    self_draft = StandaloneConfig(algorithm="standalone", draft_model_path="target")
    assert self_draft.resolve_shape("LlamaForCausalLM") == TreeShape(5, 1, 6)
    assert StandaloneConfig(algorithm="standalone", draft_model_path="target", topk=1, num_steps=3).resolve_shape("LlamaForCausalLM") == TreeShape(3, 1, 4)


def test_topk1_forces_chain_size():
    assert _shape(num_steps=4, topk=1, num_draft_tokens=9) == TreeShape(4, 1, 5)
    assert _shape(topk=1) == TreeShape(5, 1, 6)


def test_all_three_or_none():
    with pytest.raises(ConfigError, match="all three or none") as e:
        _shape(num_steps=3, topk=2)
    assert e.value.key == "speculative.num_draft_tokens"


@pytest.mark.parametrize("shape", [(3, 4, 16), (5, 8, 64), (5, 4, 8), (5, 8, 32), (2, 2, 7), (3, 2, 11)])
def test_sglang_tree_shapes_are_accepted_as_given(shape):
    """SGLang's documented shapes: the rerank picks from topk + (num_steps - 1) * topk^2 candidates."""
    assert _shape(num_steps=shape[0], topk=shape[1], num_draft_tokens=shape[2]) == TreeShape(*shape)


def test_a_tree_larger_than_the_search_offers_is_adjusted_with_a_warning(caplog):
    """(2, 2, 8), SGLang's quick-recovery recipe: 2 + 1 x 4 = 6 candidates, so 7 nodes at most."""
    with caplog.at_level("WARNING"):
        assert _shape(num_steps=2, topk=2, num_draft_tokens=8) == TreeShape(2, 2, 7)
        assert _shape(num_steps=1, topk=3, num_draft_tokens=9) == TreeShape(1, 3, 4)
    assert "num_draft_tokens=8 adjusted to 7" in caplog.text and "topk + (num_steps - 1) * topk^2 = 6" in caplog.text


def test_beam_search_offers_every_child_as_a_candidate():
    """The candidate count the shape rule relies on: topk at the first step, topk x topk after."""
    import torch

    from specfw.kv_cache import SlotAllocator
    from specfw.speculative.beam import beam_search
    from specfw.speculative.config import max_draft_candidates

    class Req:
        seq_len, params = 4, None

    vocab, alloc = 50, SlotAllocator(64)
    g = torch.Generator().manual_seed(0)

    def step(chunks, parent_hidden):
        n = sum(len(c[0]) for c in chunks)
        return torch.randn(n, vocab, generator=g), None

    for steps, topk in [(1, 3), (2, 2), (3, 4)]:
        cands = beam_search([Req()], torch.randn(1, vocab, generator=g), None, topk, steps, lambda r: torch.arange(3), alloc, step)[0]
        assert len(cands) == max_draft_candidates(steps, topk)
        assert alloc.num_used == 0


@pytest.mark.parametrize(
    "kw,key",
    [
        (dict(num_steps=0, topk=1), "speculative.num_steps"),
        (dict(accept_threshold_single=0.0), "speculative.accept_threshold_single"),
        (dict(accept_threshold_acc=1.5), "speculative.accept_threshold_acc"),
    ],
)
def test_range_rules(kw, key):
    with pytest.raises(ConfigError) as e:
        c = SpecAlgoConfig(algorithm="x", **kw)
        c.validate()
        c.resolve_shape("LlamaForCausalLM")
    assert e.value.key == key


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["speculative=ngram", "speculative.topk=2"], "speculative.topk"),
        (["speculative=ngram", "speculative.min_match_window_size=5", "speculative.max_match_window_size=3"], "speculative.min_match_window_size"),
        (["speculative=ngram", "speculative.num_draft_tokens=1"], "speculative.num_draft_tokens"),
        (["speculative=standalone", "speculative.draft_model_path=/x", "speculative.topk=2"], "speculative.num_steps"),
    ],
)
def test_startup_validation_of_composed_config(overrides, key):
    cfg = _compose(overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key


@pytest.mark.parametrize("name", ["standalone", "eagle", "eagle3"])
def test_missing_draft_for_a_non_demo_target_names_the_key(name, tiny_model_dir):
    """The committed demo drafts only serve the demo target; any other target needs a path."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager

    spec = plugin_manager().algorithms[name].config_class(algorithm=name)
    with pytest.raises(ConfigError) as e:
        Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=256, speculative=spec))
    assert e.value.key == "speculative.draft_model_path"


@pytest.mark.parametrize("option,algorithm", [("nextn", "mtp"), ("NEXTN", "mtp"), ("EAGLE3", "eagle3"), ("NGRAM", "ngram")])
def test_sglang_algorithm_names_select_the_same_options(option, algorithm):
    cfg = _compose([f"speculative={option}"])
    assert cfg.speculative.algorithm == algorithm


@pytest.mark.parametrize("value,mode", [("auto", "auto"), ("false", "false"), ("true", "true"), ("False", "false")])
def test_adaptive_draft_modes_compose(value, mode):
    from specfw.speculative.verify_cost import adaptive_mode

    cfg = _compose(["speculative=eagle3", f"speculative.adaptive_draft={value}"])
    validate(cfg)
    assert adaptive_mode(cfg.speculative.adaptive_draft) == mode


def test_adaptive_draft_typo_names_the_key_and_the_choices():
    cfg = _compose(["speculative=eagle3", "speculative.adaptive_draft=sometimes"])
    with pytest.raises(ConfigError, match=r"speculative.adaptive_draft.*'auto', 'true', 'false'"):
        validate(cfg)


def test_auto_measures_the_verify_cost_and_decides(tiny_model_dir, caplog):
    """auto: on where a verify of num_draft_tokens rows costs > GROWS_ABOVE x one row, else off;
    the decision and its reason are logged; the probe leaves the KV pool as it found it."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.speculative import verify_cost

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096))
    ratio = verify_cost.verify_cost_ratio(eng.runner, 16)
    assert ratio > 0 and eng.scheduler.kv_in_use == 0
    calls = []
    for fake, want in ((2.0, True), (1.1, True), (1.02, False)):  # the default threshold, 1.05
        verify_cost.verify_cost_ratio, real = (lambda r, n, reps=5, batch=1, f=fake: calls.append((n, batch)) or f), verify_cost.verify_cost_ratio
        try:
            with caplog.at_level("INFO"):
                assert verify_cost.resolve_adaptive("auto", eng.runner, 8) is want
        finally:
            verify_cost.verify_cost_ratio = real
    assert calls == [(8, 1)] * 3 and "adaptive_draft=auto: on" in caplog.text and "adaptive_draft=auto: off" in caplog.text
    assert verify_cost.resolve_adaptive(False, eng.runner, 8) is False and verify_cost.resolve_adaptive("true", eng.runner, 8)
    batched = verify_cost.verify_cost_ratio(eng.runner, 4, batch=3)  # 3 requests x 4 rows against 3 x 1
    assert batched > 0 and eng.scheduler.kv_in_use == 0
    eng.close()


def test_auto_does_not_time_triton_interpreted_attention(tiny_model_dir, monkeypatch):
    """Under TRITON_INTERPRET=1 the Triton attention backend runs in Python: the probe would time
    the interpreter, so it keeps the policy on without a forward."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.speculative import verify_cost

    eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_attention_backend="triton", max_total_tokens=4096))
    forwards = []
    monkeypatch.setattr(eng.runner, "forward", lambda fb: forwards.append(fb))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert verify_cost.verify_cost_ratio(eng.runner, 8) == float("inf") and verify_cost.resolve_adaptive("auto", eng.runner, 8)
    assert forwards == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels (CUDA): timed as any other backend
    assert verify_cost.verify_cost_ratio(eng.runner, 8) < float("inf") and len(forwards) == 12  # warm-up and 5 alternated pairs
    eng.close()


@pytest.mark.parametrize("running, probed", [(1, 1), (3, 3), (16, 8)])
def test_auto_probes_at_the_engines_concurrency(tiny_model_dir, monkeypatch, running, probed):
    """The probe verifies min(engine.max_running_requests, PROBE_BATCH) requests at once: with one
    request a small tree's cost is within this CPU's timing noise of a plain step's."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.speculative import verify_cost

    seen = []
    monkeypatch.setattr(verify_cost, "verify_cost_ratio", lambda runner, rows, reps=5, batch=1: seen.append((rows, batch)) or 2.0)
    spec = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram")
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=running, speculative=spec)) as eng:
        assert eng.worker.policy.adaptive and eng.worker.policy.fixed_batches == frozenset()
    n = eng.tree_shape.num_draft_tokens
    assert seen == [(n, probed)] + ([(n, 1)] * (probed > 1))  # several requests: one request's tree is timed too


def test_one_requests_steps_keep_the_tree_where_its_verify_is_flat(tiny_model_dir, monkeypatch, caplog):
    """A server's policy is on for its concurrency (8 requests' trees cost ~4.5x their rows); where one
    request's tree verifies within the algorithm's threshold, steps of one request play the configured
    tree (``fixed_batches``); under the default threshold the same 1.3x keeps the policy there too."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.speculative import verify_cost

    monkeypatch.setattr(verify_cost, "verify_cost_ratio", lambda runner, rows, reps=5, batch=1: 4.5 if batch > 1 else 1.3)
    ngram = plugin_manager().algorithms["ngram"].config_class
    for threshold, want in ((None, frozenset()), (1.5, frozenset({1}))):
        if threshold is not None:
            monkeypatch.setattr(ngram, "adaptive_grows_above", threshold)
        caplog.clear()
        cfg = make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=8, speculative=ngram(algorithm="ngram"))
        with caplog.at_level("INFO"), Engine(cfg) as eng:
            assert eng.worker.policy.adaptive and eng.worker.policy.fixed_batches == want
        assert ("steps with one request in flight verify the configured tree" in caplog.text) == bool(want)
    monkeypatch.setattr(ngram, "adaptive_grows_above", 1.5)
    fixed = make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=8, speculative=ngram(algorithm="ngram", adaptive_draft=True))
    with Engine(fixed) as eng:  # adaptive_draft=true: the policy everywhere, as asked
        assert eng.worker.policy.adaptive and eng.worker.policy.fixed_batches == frozenset()


def test_auto_uses_the_algorithms_own_threshold(tiny_model_dir, monkeypatch, caplog):
    """``adaptive_grows_above``, a class attribute of the algorithm's config: the same probe result
    (1.3x) turns the policy on under the default threshold (1.05) and off under one of 1.5, EAGLE-3's;
    the log names the threshold."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.speculative import verify_cost
    from specfw.speculative.config import SpecAlgoConfig

    algos = plugin_manager().algorithms
    assert SpecAlgoConfig.adaptive_grows_above == verify_cost.GROWS_ABOVE == 1.05
    assert algos["eagle3"].config_class.adaptive_grows_above == 1.5
    assert algos["ngram"].config_class.adaptive_grows_above == 1.05
    monkeypatch.setattr(verify_cost, "verify_cost_ratio", lambda runner, rows, reps=5, batch=1: 1.3)
    ngram = algos["ngram"].config_class
    for threshold, want in ((None, True), (1.5, False)):
        if threshold is not None:
            monkeypatch.setattr(ngram, "adaptive_grows_above", threshold)
        caplog.clear()
        with caplog.at_level("INFO"), Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, speculative=ngram(algorithm="ngram"))) as eng:
            assert eng.worker.policy.adaptive is want
        assert f"threshold {threshold or 1.05:.2f}x" in caplog.text


def test_the_self_draft_keeps_its_chain_where_one_requests_verify_is_below_1_5(tiny_model_dir, monkeypatch, caplog):
    """A standalone self-draft (``draft_model_path=target``) takes EAGLE-3's threshold, 1.5x; a
    standalone draft model keeps the default: the same 1.3x probe leaves the self-draft's chain
    fixed and turns the policy on for the other."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.speculative import verify_cost
    from specfw_plugins.standalone.config import StandaloneConfig

    assert StandaloneConfig(algorithm="standalone", draft_model_path="target").grows_above() == 1.5
    assert StandaloneConfig(algorithm="standalone").grows_above() == StandaloneConfig.adaptive_grows_above == 1.05
    monkeypatch.setattr(verify_cost, "verify_cost_ratio", lambda runner, rows, reps=5, batch=1: 1.3)
    spec = StandaloneConfig(algorithm="standalone", draft_model_path="target", draft_model_quantization="w8a8_int8")
    with caplog.at_level("INFO"), Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, speculative=spec)) as eng:
        assert eng.worker.policy.adaptive is False
    assert "threshold 1.50x" in caplog.text


def test_auto_is_off_on_cuda_without_a_probe(caplog):
    """On a CUDA device auto means SGLang's fixed tree: no forward is timed (the probe's eager
    forwards are not the graphed ones that serve); explicit true still turns the policy on."""
    from types import SimpleNamespace

    from specfw.speculative import verify_cost

    runner = SimpleNamespace(device=torch.device("cuda"), forward=lambda fb: pytest.fail("the probe ran a forward"))
    with caplog.at_level("INFO"):
        assert verify_cost.resolve_adaptive("auto", runner, 8, batch=8) is False
    assert "off on a CUDA device" in caplog.text
    assert verify_cost.resolve_adaptive("true", runner, 8) is True
