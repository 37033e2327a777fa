import pytest
from hydra import compose, initialize_config_module

from specfw.config import ConfigError, validate
from specfw.config_store import register_configs


def _compose(name, overrides):
    register_configs()
    with initialize_config_module("specfw_conf", version_base="1.3"):
        return compose(name, overrides=overrides)


@pytest.mark.parametrize("name", ["generate", "serve"])
def test_default_configs_compose(name):
    cfg = _compose(name, [])
    assert cfg.model.path is None and cfg.speculative.algorithm == "none"
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 30000
    validate(cfg)


def test_unknown_key_fails_naming_it():
    with pytest.raises(Exception) as e:
        _compose("serve", ["engine.max_runing_requests=3"])
    assert "max_runing_requests" in str(e.value) or "max_runing_requests" in str(e.value.__cause__)


def test_bad_enum_lists_allowed_values():
    with pytest.raises(Exception) as e:
        _compose("serve", ["model.dtype=bf16"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "model.dtype" in msg and "float32" in msg and "bfloat16" in msg


def test_bad_type_fails():
    with pytest.raises(Exception) as e:
        _compose("serve", ["server.port=abc"])
    assert "server.port" in str(e.value) + str(e.value.__cause__)


def test_unknown_speculative_option_lists_options():
    with pytest.raises(Exception) as e:
        _compose("serve", ["speculative=nope"])
    assert "none" in str(e.value)


@pytest.mark.parametrize(
    "override,key",
    [
        ("engine.max_running_requests=0", "engine.max_running_requests"),
        ("engine.kv_cache_memory_gb=-1", "engine.kv_cache_memory_gb"),
        ("server.port=70000", "server.port"),
        ("server.log_level=loud", "server.log_level"),
        ("engine.max_total_tokens=0", "engine.max_total_tokens"),
        ("model.device=gpu", "model.device"),
    ],
)
def test_range_validation_names_key(override, key):
    cfg = _compose("serve", [override])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key and str(e.value).startswith(key)


def test_model_group_options():
    cfg = _compose("generate", ["model=demo_bf16", "prompt=hi", "max_new_tokens=5"])
    assert cfg.model.dtype.value == "bfloat16" and cfg.prompt == "hi" and cfg.max_new_tokens == 5
