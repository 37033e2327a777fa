"""The server reliability suite (issue 16): every test here is marked ``reliability`` and left out
of the default run; run it with ``.venv/bin/python -m pytest tests/reliability -m reliability``.
All traffic goes to servers on 127.0.0.1 started by the tests. The figures each test records are
printed at the end of the run and written to ``$SPECFW_RELIABILITY_REPORT`` (default
``reliability-report.json`` in the temp directory)."""

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))  # conftest.make_cfg, server_helpers

FIGURES: dict = {}


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture
def figures(request):
    """A dict for this test's figures (reported at the end of the run)."""
    return FIGURES.setdefault(request.node.name, {})


def pytest_terminal_summary(terminalreporter):
    if not FIGURES:
        return
    path = Path(os.environ.get("SPECFW_RELIABILITY_REPORT", Path(tempfile.gettempdir()) / "reliability-report.json"))
    path.write_text(json.dumps(FIGURES, indent=1, sort_keys=True))
    terminalreporter.section("reliability figures")
    for name, figs in FIGURES.items():
        terminalreporter.write_line(f"{name}: {json.dumps(figs, sort_keys=True)}")
    terminalreporter.write_line(f"(written to {path})")
