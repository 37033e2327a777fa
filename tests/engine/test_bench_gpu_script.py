"""benchmarks/bench_gpu.py (what scripts/gpu_check.sh runs on a GPU) runs end to end on a CPU
with the tiny model: the table and records are written and speculative rows are compared with
plain on the same backend."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_smoke_run_on_a_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--model", "tiny", "--backends", "torch"]
    cmd += ["--algos", "plain,ngram,ngram"]
    cmd += ["--prompts", "2", "--new-tokens", "8", "--batch-sizes", "1,2", "--dtype", "float32", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    table = (tmp_path / "results.md").read_text()
    assert "no GPU (cpu)" in table and "| torch | ngram | 2 |" in table
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(x["algo"], x["batch_size"]) for x in records] == [("plain", 1), ("plain", 2)] + [("ngram", 1), ("ngram", 2)] * 2  # a repeated row runs again
    assert all(x["same"] == "2/2" for x in records if x["algo"] == "ngram") and all(x["tok_s"] > 0 for x in records)


def test_gpu_lease_call_script_parses_and_names_its_calls():
    """scripts/gpu_lease_call.sh (a GPU lease's two device calls, docs/gpu.md) is valid bash and
    answers a call it does not know with its usage, exit 2, before touching anything."""
    script = ROOT / "scripts" / "gpu_lease_call.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    r = subprocess.run(["bash", str(script), "3"], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr and "1|2" in r.stderr
