"""Meta-tests: the config reference is generated from the schemas, and every hook spec is
documented (the contract for algorithm authors) and implemented by a built-in."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from specfw import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("specfw_")]


def test_config_reference_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"], timeout=120)
    assert r.returncode == 0, "docs/config.md is stale: run scripts/gen_config_docs.py"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_spec_documented(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert len(doc) > 60, f"{name} needs a docstring describing when it is called and what it returns"
    assert name in (ROOT / "docs" / "plugins.md").read_text(), f"{name} missing from docs/plugins.md"


def test_every_hook_has_a_builtin_implementation():
    import specfw_plugins.eagle3.drafter as e3
    import specfw_plugins.ngram as ng
    import specfw_plugins.standalone as sap
    import specfw_plugins.standalone.drafter as sa
    from specfw.speculative import defaults, feature_drafter

    sources = [defaults, ng, ng.drafter.NgramDrafter, ng.assist.NgramAssist, sa.StandaloneDrafter, feature_drafter.FeatureDrafter, e3, sap]
    implemented = {n for s in sources for n in dir(s) if n.startswith("specfw_")}
    implemented.add("specfw_observe_step")  # observers: exercised in tests/engine/test_plugins.py
    assert set(HOOKS) <= implemented, set(HOOKS) - implemented
