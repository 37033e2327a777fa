"""Every speculative option composes; each validation rule produces its message."""
import pytest
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


def test_topk1_forces_chain_size():
    assert _shape(num_steps=4, topk=1, num_draft_tokens=9) == TreeShape(4, 1, 5)
    assert _shape(topk=1) == TreeShape(5, 1, 6)


def test_all_three_or_none():
    with pytest.raises(ConfigError, match="all three or none") as e:
        _shape(num_steps=3, topk=2)
    assert e.value.key == "speculative.num_draft_tokens"


def test_impossible_tree_rejected():
    with pytest.raises(ConfigError, match=r"num_steps \* topk \+ 1 = 5") as e:
        _shape(num_steps=2, topk=2, num_draft_tokens=6)
    assert e.value.key == "speculative.num_draft_tokens"


@pytest.mark.parametrize("kw,key", [(dict(num_steps=0, topk=1), "speculative.num_steps"),
                                    (dict(accept_threshold_single=0.0), "speculative.accept_threshold_single"),
                                    (dict(accept_threshold_acc=1.5), "speculative.accept_threshold_acc")])
def test_range_rules(kw, key):
    with pytest.raises(ConfigError) as e:
        c = SpecAlgoConfig(algorithm="x", **kw)
        c.validate()
        c.resolve_shape("LlamaForCausalLM")
    assert e.value.key == key


@pytest.mark.parametrize("overrides,key", [
    (["speculative=ngram", "speculative.topk=2"], "speculative.topk"),
    (["speculative=ngram", "speculative.min_match_window_size=5", "speculative.max_match_window_size=3"],
     "speculative.min_match_window_size"),
    (["speculative=ngram", "speculative.num_draft_tokens=1"], "speculative.num_draft_tokens"),
    (["speculative=standalone", "speculative.draft_model_path=/x", "speculative.topk=2"], "speculative.num_steps"),
])
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
