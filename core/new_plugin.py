"""``specfw new-plugin NAME [DIR]``: write a plugin package to start from: pyproject with the
entry point, a config dataclass, a drafter, and a test that runs the plugin test kit."""

from __future__ import annotations

import re
from pathlib import Path

PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "specfw-{name}"
version = "0.1.0"
description = "specfw speculative algorithm '{name}'"
requires-python = ">=3.10"
dependencies = ["specfw"]

[project.optional-dependencies]
test = ["pytest>=8"]

# specfw finds the algorithm through this entry point.
[project.entry-points.specfw]
{name} = "specfw_{name}"

[tool.setuptools]
packages = ["specfw_{name}"]
"""

INIT = '''"""specfw algorithm '{name}'. Registered through the `specfw` entry-point group."""
from __future__ import annotations

from specfw.sdk import hookimpl

from .config import {cls}Config
from .drafter import {cls}Drafter


@hookimpl
def specfw_register_algorithms(register):
    register("{name}", {cls}Config, {cls}Drafter, "TODO: one line on what {name} drafts from")
'''

CONFIG = '''"""`speculative={name}` options: the fields become Hydra keys, validated at startup."""
from __future__ import annotations

from dataclasses import dataclass

from specfw.sdk import ConfigError, SpecAlgoConfig, TreeShape


@dataclass
class {cls}Config(SpecAlgoConfig):
    min_gap: int = 1      # ignore matches closer than this to the end of the sequence

    # inherited keys this drafter never reads: setting one is an error naming it
    unused_keys = ("draft_model_path", "draft_model_revision", "draft_model_quantization")
    # values `specfw tune speculative={name}` tries for keys of your own, beside the tree keys
    tune_grid = {{"min_gap": ("1", "4")}}

    def auto_shape(self, target_arch: str) -> TreeShape:
        return TreeShape(4, 1, 5)   # (num_steps, topk, num_draft_tokens): a chain of 4

    def validate(self) -> None:
        super().validate()
        if self.min_gap < 1:
            raise ConfigError("speculative.min_gap", f"must be >= 1, got {{self.min_gap}}")
'''

DRAFTER = '''"""The runtime: built once per engine; its hooks are called on the engine thread."""
from __future__ import annotations

from specfw.sdk import DraftCandidates, hookimpl


class {cls}Drafter:
    def __init__(self, ctx):
        self.depth = ctx.shape.num_steps
        self.min_gap = ctx.config.min_gap

    def propose(self, seq: list[int]) -> list[int]:
        """Copy what followed the last token's previous occurrence (replace with your drafter)."""
        last = seq[-1]
        for i in range(len(seq) - 1 - self.min_gap, -1, -1):
            if seq[i] == last:
                return seq[i + 1:i + 1 + self.depth]
        return []

    @hookimpl
    def specfw_draft(self, ctx, reqs):
        return [DraftCandidates.chain(self.propose(r.seq_ids)) for r in reqs]
'''

TEST = '''"""The contract: greedy speculative output == plain greedy output (fp32/bf16, batch 1/4)."""
from specfw.testing import check_lossless


def test_lossless_default_shape():
    check_lossless("{name}")


def test_lossless_chain_of_two():
    check_lossless("{name}", {{"num_steps": 2, "topk": 1}})
'''

README = """# specfw-{name}

```bash
pip install -e '.[test]'             # into the environment specfw is installed in
specfw plugins                       # lists {name}
specfw generate speculative={name} prompt="Count from 1 to 20."
python -m pytest tests               # the plugin test kit (specfw.testing), seconds
```
"""


def write_plugin(name: str, dest: str | Path | None = None) -> Path:
    """Write the package ``specfw-<name>`` into ``dest`` (default ``./specfw-<name>``); returns it."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"plugin name '{name}' must be a lowercase identifier (letters, digits, _)")
    root = Path(dest) if dest else Path(f"specfw-{name}")
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{root} exists and is not empty")
    cls = "".join(p.capitalize() for p in name.split("_"))
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"specfw_{name}/__init__.py": INIT,
        f"specfw_{name}/config.py": CONFIG,
        f"specfw_{name}/drafter.py": DRAFTER,
        f"tests/test_{name}.py": TEST,
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text.format(name=name, cls=cls))
    return root
