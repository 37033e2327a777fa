"""What a plugin author trips over, each failing clearly (issue 18, item 6): an unknown
SPECFW_PLUGINS name, a hook without @hookimpl, a ``+speculative.<typo>`` key, an inherited key
the algorithm does not use."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from specfw.hookspecs import hookimpl
from specfw.plugins import PluginError, PluginManager
from specfw.speculative.config import SpecAlgoConfig

BIN = Path(sys.executable).parent


def test_unknown_specfw_plugins_name_is_an_error(monkeypatch):
    monkeypatch.setenv("SPECFW_PLUGINS", "ngarm")
    with pytest.raises(PluginError, match=r"SPECFW_PLUGINS names \['ngarm'\].*installed: .*ngram"):
        PluginManager()
    r = subprocess.run([str(BIN / "specfw"), "plugins"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("specfw plugins: error: SPECFW_PLUGINS names ['ngarm']"), r.stderr


def test_unknown_disabled_name_only_warns(monkeypatch, caplog):
    monkeypatch.setenv("SPECFW_DISABLE_PLUGINS", "ngarm")
    assert "ngram" in PluginManager().algorithms
    assert "SPECFW_DISABLE_PLUGINS names ['ngarm']" in caplog.text


@dataclass
class _Cfg(SpecAlgoConfig):
    pass


class _Forgot:
    def __init__(self, ctx):
        pass

    def specfw_draft(self, ctx, reqs, plan=None):  # no @hookimpl: pluggy would skip it silently
        return []


def test_hook_without_marker_fails_with_a_hint():
    class Plugin:
        @hookimpl
        def specfw_register_algorithms(self, register):
            register("forgot", _Cfg, _Forgot)

    with pytest.raises(PluginError, match=r"specfw_draft without the @hookimpl marker"):
        PluginManager(load_entry_points=False).register(Plugin(), "forgot")

    class Module:  # a distribution plugin whose registration hook lacks the marker
        def specfw_register_algorithms(self, register):
            pass

    with pytest.raises(PluginError, match="specfw_register_algorithms without the @hookimpl marker"):
        PluginManager(load_entry_points=False).register(Module(), "module")


def test_unused_inherited_key_is_rejected_naming_it():
    from specfw.config import ConfigError
    from specfw_plugins.ngram.config import NgramConfig

    NgramConfig(algorithm="ngram").validate()
    with pytest.raises(ConfigError, match="speculative.draft_model_path: is not used by speculative=ngram"):
        NgramConfig(algorithm="ngram", draft_model_path="/x").validate()


def test_plus_typo_key_fails_naming_it():
    r = subprocess.run([str(BIN / "specfw"), "generate", "speculative=ngram", "+speculative.min_gapp=1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "speculative.min_gapp: is not a key" in r.stderr, r.stderr
    r = subprocess.run([str(BIN / "specfw"), "generate", "speculative=ngram", "speculative.draft_model_path=/x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "speculative.draft_model_path" in r.stderr, r.stderr


@pytest.mark.model
def test_sweep_prints_job_labels_and_leaves_no_multirun_dir(tmp_path, demo_dir):
    r = subprocess.run(
        [str(BIN / "specfw"), "generate", "-m", "speculative=none,ngram", "prompt=hi", "max_new_tokens=4"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "[job 0] speculative=none" in r.stdout and "[job 1] speculative=ngram" in r.stdout
    assert list(tmp_path.iterdir()) == []
