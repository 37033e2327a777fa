"""Every package directory ships in a non-editable install: pyproject's explicit package list
names each one (a missing entry installs fine and fails at the first import of it)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    for name, src in cfg["package-dir"].items():
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src)
            if any(part.startswith((".", "_")) or part in ("demo_draft", "tests") for part in rel.parts):
                continue
            pkg = ".".join([name, *rel.parts])
            assert pkg in listed, f"{pkg} ({init.parent}) is missing from [tool.setuptools] packages in pyproject.toml"
