"""`ruff check` and `ruff format --check` over the repository with the config in pyproject.toml (skipped where ruff is not
installed; `scripts/setup.sh` installs it with the dev extra)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff() -> str | None:
    local = Path(sys.executable).parent / "ruff"
    return str(local) if local.exists() else shutil.which("ruff")


@pytest.mark.skipif(ruff() is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_check_passes():
    r = subprocess.run(
        [ruff(), "check", "--no-cache", "core", "plugins", "tests", "scripts", "benchmarks", "examples"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(ruff() is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_code_is_ruff_formatted():
    r = subprocess.run(
        [ruff(), "format", "--check", "--no-cache", "core", "plugins", "tests", "scripts", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, "run `ruff format` (pyproject.toml has its settings):\n" + r.stdout + r.stderr
