"""The core never imports a plugin: algorithms and their trainers reach it only through the
``specfw`` entry points (``specfw_register_algorithms``, ``specfw_register_trainers``). And the
plugins (built-in and the example) import from the core only ``specfw.sdk``, the documented
surface (their tests may use ``specfw.testing``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
PLUGIN_SOURCES = [*sorted((ROOT / "plugins").rglob("*.py")), *sorted((ROOT / "examples" / "specfw-example-plugin" / "specfw_bigram").rglob("*.py"))]


def plugin_imports(path: Path) -> list[str]:
    """``specfw_plugins`` imports in one file, including lazy ones and ``import_module("specfw_plugins...")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], (ast.Constant, ast.JoinedStr))
        ):
            names = [ast.unparse(node.args[0])]
        found += [f"{path.relative_to(CORE.parent)}:{node.lineno}: {n}" for n in names if "specfw_plugins" in n]
    return found


def test_core_imports_no_plugin():
    bad = [hit for f in sorted(CORE.rglob("*.py")) for hit in plugin_imports(f)]
    assert not bad, "the core imports plugins:\n" + "\n".join(bad)


def core_imports(path: Path) -> list[str]:
    """``specfw`` modules (not ``specfw_plugins``) one file imports, lazy imports included."""
    found, rel = [], path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            else []
        )
        found += [f"{rel}:{node.lineno}: {n}" for n in names if n == "specfw" or n.startswith("specfw.")]
    return found


def test_plugins_import_only_the_sdk():
    assert len(PLUGIN_SOURCES) > 20
    bad = [hit for f in PLUGIN_SOURCES for hit in core_imports(f) if not hit.endswith(": specfw.sdk")]
    assert not bad, "plugins reach past specfw.sdk:\n" + "\n".join(bad)


def test_the_checker_sees_a_reach_past_the_sdk(tmp_path):
    f = tmp_path / "p.py"
    f.write_text("from specfw.sdk import hookimpl\nimport specfw_plugins.ngram\n\n\ndef f():\n    from specfw.kv_cache import KVPool\n")
    assert [h.split(": ")[1] for h in core_imports(f)] == ["specfw.sdk", "specfw.kv_cache"]


def test_sdk_exports_resolve():
    import specfw.sdk as sdk

    missing = [n for n in sdk.__all__ if not hasattr(sdk, n)]
    assert not missing and len(sdk.__all__) == len(set(sdk.__all__))
    assert {
        "hookimpl",
        "SpecContext",
        "StepPlan",
        "DraftCandidates",
        "FeatureDrafter",
        "beam_search",
        "place_on_target",
        "target_dtype",
        "DraftTrainConfig",
    } <= set(sdk.__all__)


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
