"""benchmarks/bench_side_by_side.py: configuration parsing and one end-to-end run on the demo target."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_side_by_side import parse  # noqa: E402


def test_parse_names_and_typed_keys():
    assert parse("plain=") == ("plain", {})
    assert parse("eagle full=algorithm=eagle,token_map=full,adaptive_draft=False,num_steps=3") == (
        "eagle full",
        {"algorithm": "eagle", "token_map": "full", "adaptive_draft": False, "num_steps": 3},
    )


@pytest.mark.model
def test_runs_configurations_side_by_side_and_checks_outputs():
    """Two specfw engines, two more in bf16 (``model.dtype``: checked against the first bf16 row)
    and one HF transformers row (``backend=hf``) in one run."""
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_side_by_side.py"),
            "--n",
            "1",
            "--max-new-tokens",
            "8",
            "--rounds",
            "1",
            "plain=",
            "ngram=algorithm=ngram",
            "plain bf16=model.dtype=bfloat16",
            "ngram bf16=algorithm=ngram,model.dtype=bfloat16",
            "hf pl=backend=hf,prompt_lookup_num_tokens=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(("plain ", "ngram ")) and " bf16 " not in line[:11]]
    assert len(lines) == 2 and all("== plain: yes" in line for line in lines)
    bf16 = [line for line in r.stdout.splitlines() if line.startswith(("plain bf16 ", "ngram bf16 "))]
    assert len(bf16) == 2 and all("== plain bf16: yes" in line for line in bf16)
    assert "x plain bf16 (rounds: " in bf16[1]  # its ratio to the first row of its dtype
    # an HF transformers row (prompt lookup): timed beside them, its outputs compared, not required equal
    hf = [line for line in r.stdout.splitlines() if line.startswith("hf pl ")]
    assert len(hf) == 1 and "tok/s" in hf[0] and "== plain: " in hf[0] and hf[0].rstrip().endswith("/1")
    assert "cpus, torch threads" in r.stdout  # the machine is named
