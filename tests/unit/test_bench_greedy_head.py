"""benchmarks/bench_greedy_head.py: the greedy head's proxies timed side by side, on a tiny model."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_times_both_proxies_and_checks_their_argmax(tiny_model_dir):
    from specfw.kernels import cpu_ops

    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_greedy_head.py"), "--model", str(tiny_model_dir), "--rows", "1,3", "--reps", "3", "--prompts", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if cpu_ops() is None:
        assert r.returncode != 0 and "greedy head" in r.stdout + r.stderr
        return
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 2 and all("int8" in line and "bf16" in line for line in rows)  # both proxies' candidates, every argmax checked
    assert "CPU:" in r.stdout and "int8/bf16" in r.stdout
