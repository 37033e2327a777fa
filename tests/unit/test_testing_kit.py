"""The plugin test kit (specfw.testing) and `specfw new-plugin`: a freshly written plugin package
registers, lists its hooks, and passes check_lossless; a verifier that breaks the contract fails it."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from specfw.hookspecs import hookimpl
from specfw.plugins import plugin_manager
from specfw.testing import check_lossless

BIN = Path(sys.executable).parent


@pytest.fixture
def new_plugin(tmp_path):
    r = subprocess.run([str(BIN / "specfw"), "new-plugin", "kitdemo", str(tmp_path / "pkg")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    sys.path.insert(0, str(tmp_path / "pkg"))
    try:
        module = importlib.import_module("specfw_kitdemo")
        plugin_manager().register(module, "kitdemo")
        yield tmp_path / "pkg"
        plugin_manager().unregister("kitdemo")
    finally:
        sys.path.remove(str(tmp_path / "pkg"))
        for m in [m for m in sys.modules if m.startswith("specfw_kitdemo")]:
            del sys.modules[m]


def test_new_plugin_template_passes_the_kit(new_plugin):
    root = new_plugin
    assert 'kitdemo = "specfw_kitdemo"' in (root / "pyproject.toml").read_text()
    assert "check_lossless" in (root / "tests" / "test_kitdemo.py").read_text()
    report = check_lossless("kitdemo", {"num_steps": 2, "topk": 1})
    assert set(report.runs) == {("float32", 1), ("float32", 4), ("bfloat16", 1), ("bfloat16", 4)}
    assert report.accepted > 0
    from specfw.cli import implemented_hooks

    assert implemented_hooks(plugin_manager().algorithms["kitdemo"].factory) == ["specfw_draft"]


def test_new_plugin_refuses_bad_names(tmp_path):
    r = subprocess.run([str(BIN / "specfw"), "new-plugin", "My-Algo", str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "lowercase identifier" in r.stderr


def test_kit_catches_a_lossy_verifier(new_plugin):
    """A plugin whose verifier accepts every draft token breaks the contract: the kit says where."""
    from specfw_kitdemo.drafter import KitdemoDrafter

    class Lossy(KitdemoDrafter):
        @hookimpl
        def specfw_verify(self, ctx, req, tree, logits):
            from specfw.speculative import defaults

            res = defaults.specfw_verify(ctx, req, tree, logits, None)
            res.tokens[-1] = (res.tokens[-1] + 1) % 1000  # a wrong bonus token
            return res

    algo = plugin_manager().algorithms["kitdemo"]
    algo.factory, original = Lossy, algo.factory
    try:
        with pytest.raises(AssertionError, match=r"float32, batch 1: prompt \d+ diverges"):
            check_lossless("kitdemo", {"num_steps": 2, "topk": 1}, dtypes=("float32",), batch_sizes=(1,))
    finally:
        algo.factory = original


def test_unregistered_name_says_how_to_fix():
    with pytest.raises(AssertionError, match="entry point"):
        check_lossless("no_such_algo")


def test_a_third_party_algorithms_tune_grid_joins_specfw_tune(new_plugin):
    """The template's ``tune_grid`` (min_gap 1 and 4) is a dimension of ``specfw tune``'s grid for
    the plugin's algorithm, as ngram's match_type is for the built-in one."""
    from hydra import compose, initialize_config_module

    from specfw.bench.tune import grid
    from specfw.config_store import register_configs

    register_configs()
    with initialize_config_module("specfw_conf", version_base="1.3"):
        cfg = compose("tune", ["speculative=kitdemo", "tune.num_steps=[2]", "tune.topk=[1]", "tune.num_draft_tokens=[3]", "tune.adaptive_draft=[false]"])
    points, skipped = grid(cfg)
    chain = dict(num_steps=2, topk=1, num_draft_tokens=3, adaptive_draft="false")
    assert points == [{}, dict(chain, min_gap="1"), dict(chain, min_gap="4")] and not skipped
