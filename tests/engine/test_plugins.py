"""Plugin discovery through entry points, allow/block lists, the `specfw plugins` command,
hook validation, and a pip-installed third-party algorithm run end to end."""

import subprocess
import sys
from pathlib import Path

import pytest

from specfw import hookspecs
from specfw.plugins import PluginError, PluginManager

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_builtins_register_through_entry_points():
    pm = PluginManager()
    rows = {a.name: a for a in pm.describe()}
    assert rows["ngram"].module == "specfw_plugins.ngram" and rows["ngram"].package == "specfw"
    assert rows["standalone"].module == "specfw_plugins.standalone"


def test_allow_and_block_lists(monkeypatch):
    monkeypatch.setenv("SPECFW_PLUGINS", "ngram")
    assert [a.name for a in PluginManager().describe()] == ["ngram"]
    monkeypatch.delenv("SPECFW_PLUGINS")
    monkeypatch.setenv("SPECFW_DISABLE_PLUGINS", "ngram")
    assert "ngram" not in {a.name for a in PluginManager().describe()}


def test_in_process_plugin_registration_and_duplicates():
    from specfw.speculative.config import SpecAlgoConfig

    class MyPlugin:
        @hookspecs.hookimpl
        def specfw_register_algorithms(self, register):
            register("mine", SpecAlgoConfig, lambda ctx: None, "test")

    pm = PluginManager(load_entry_points=False)
    pm.register(MyPlugin(), "mine")
    assert [a.name for a in pm.describe()] == ["mine"]
    with pytest.raises(PluginError, match="registered twice"):
        pm.register(MyPlugin(), "mine-again")


def test_bad_config_class_rejected():
    class Bad:
        @hookspecs.hookimpl
        def specfw_register_algorithms(self, register):
            register("bad", dict, lambda ctx: None)

    with pytest.raises(PluginError, match="SpecAlgoConfig"):
        PluginManager(load_entry_points=False).register(Bad(), "bad")


def test_hook_typo_is_caught():
    import pluggy

    class Typo:
        @hookspecs.hookimpl
        def specfw_drfat(self, ctx, reqs):
            return []

    with pytest.raises(pluggy.PluginValidationError):
        PluginManager(load_entry_points=False).register(Typo(), "typo")


def test_specfw_plugins_command_lists_algorithms():
    r = subprocess.run([str(BIN / "specfw"), "plugins"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "ngram" in r.stdout and "standalone" in r.stdout and "specfw" in r.stdout


@pytest.mark.model
def test_third_party_package_installs_and_runs(demo_dir):
    """pip-install examples/specfw-example-plugin; `speculative=bigram` then appears as a Hydra option
    with its own key, and greedy output equals plain output. The package is uninstalled afterwards
    unless it was installed before: a later run's tests must not depend on this one having run
    (the exactness tests are parametrized over every registered algorithm)."""
    pip = str(BIN / "pip")
    was_installed = subprocess.run([pip, "show", "-q", "specfw-bigram"], capture_output=True, timeout=120).returncode == 0
    try:
        _install_and_run_the_example_plugin()
    finally:
        if not was_installed:
            subprocess.run([pip, "uninstall", "-y", "-q", "specfw-bigram"], capture_output=True, timeout=300)


def _install_and_run_the_example_plugin():
    r = subprocess.run(
        [str(BIN / "pip"), "install", "-q", "--no-deps", "--no-build-isolation", str(ROOT / "examples" / "specfw-example-plugin")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    listing = subprocess.run([str(BIN / "specfw"), "plugins"], capture_output=True, text=True, timeout=60).stdout
    assert "bigram" in listing and "specfw-bigram" in listing
    prompt = "prompt='Count from 1 to 20, separated by commas.'"
    args = [str(BIN / "specfw"), "generate", prompt, "max_new_tokens=40"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300)
    spec = subprocess.run(
        args + ["speculative=bigram", "speculative.min_gap=1", "speculative.num_steps=4", "speculative.topk=1"], capture_output=True, text=True, timeout=300
    )
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "accept len" in spec.stderr
    bad = subprocess.run(args + ["speculative=bigram", "speculative.min_gap=0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "speculative.min_gap" in bad.stderr
    # the example README's commands run as written, its own tests (the plugin test kit only) pass
    readme = (ROOT / "examples" / "specfw-example-plugin" / "README.md").read_text()
    for line in [ln.split("  #")[0].strip() for ln in readme.splitlines() if ln.startswith("specfw ")]:
        r = subprocess.run(["bash", "-c", f"{BIN}/{line}"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (line, r.stderr[-2000:])
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/specfw-example-plugin/tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:]


def test_observer_hook_sees_every_speculative_step(tiny_model_dir):
    """A distribution plugin implementing specfw_observe_step is called after each speculative
    decode step (including steps the draft budget ran without a draft)."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.sampling import SamplingParams
    from specfw_plugins.ngram.config import NgramConfig

    class Observer:
        def __init__(self):
            self.steps, self.accepted = 0, 0

        @hookspecs.hookimpl
        def specfw_observe_step(self, ctx, reqs, results):
            self.steps += 1
            self.accepted += sum(r.num_accepted for r in results)

    obs = Observer()
    pm = plugin_manager()
    pm.register(obs, "test-observer")
    try:
        eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=2048, speculative=NgramConfig(algorithm="ngram", num_draft_tokens=4)))
        eng.generate([[5, 6, 7, 8] * 3], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    finally:
        pm.unregister("test-observer")
    assert obs.steps == eng.stats.decode_steps > 0 and eng.stats.verify_forwards > 0
    assert obs.accepted == eng.stats.accepted_draft_tokens
