"""The core never imports a plugin: algorithms and their trainers reach it only through the
``specfw`` entry points (``specfw_register_algorithms``, ``specfw_register_trainers``)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "core"


def plugin_imports(path: Path) -> list[str]:
    """``specfw_plugins`` imports in one file, including lazy ones and ``import_module("specfw_plugins...")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
            names = [ast.unparse(node.args[0])]
        found += [f"{path.relative_to(CORE.parent)}:{node.lineno}: {n}" for n in names if "specfw_plugins" in n]
    return found


def test_core_imports_no_plugin():
    bad = [hit for f in sorted(CORE.rglob("*.py")) for hit in plugin_imports(f)]
    assert not bad, "the core imports plugins:\n" + "\n".join(bad)


def test_every_builtin_algorithm_registers_a_trainer_option():
    from hydra import compose, initialize_config_module

    from specfw.config_store import register_configs
    from specfw.plugins import plugin_manager
    register_configs()
    trainers = plugin_manager().trainers
    assert {"eagle", "eagle3", "mtp", "standalone"} <= set(trainers)
    with initialize_config_module(config_module="specfw_conf", version_base="1.3"):
        for kind in trainers:
            cfg = compose(config_name="train", overrides=[f"draft={kind}"])
            assert cfg.draft.kind == kind


def test_unknown_or_invalid_draft_kind_fails_naming_the_key():
    from omegaconf import OmegaConf

    from specfw.config import ConfigError
    from specfw.train.config import TrainConfig, validate_train
    from specfw_plugins.standalone.config import StandaloneTrainConfig
    cfg = OmegaConf.structured(TrainConfig(draft=StandaloneTrainConfig(num_layers=9)))
    with pytest.raises(ConfigError, match="draft.num_layers"):
        validate_train(cfg)
    cfg.draft.kind = "nope"
    with pytest.raises(ConfigError, match="draft.kind"):
        validate_train(cfg)
