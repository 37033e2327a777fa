"""Schemathesis over the live ``/openapi.json`` with all its checks (``positive_data_acceptance``
in the variant of ``schemathesis_hooks.py``; ``max_response_time`` at 120 s, as a request may
generate 128 choices on 2 busy cores): at least 1,000 generated cases and no failure."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from .servers import serve

HERE = Path(__file__).parent
KEY = "fuzz-key"


def test_schemathesis_all_checks(tiny_model_dir, figures):
    exe = Path(sys.executable).parent / "schemathesis"
    with serve(
        api_key=KEY, model_path=str(tiny_model_dir), model_context_length=64, max_total_tokens=8192, max_running_requests=128, batch_invariant=False
    ) as srv:
        t0 = time.monotonic()
        run = subprocess.run(
            [
                str(exe),
                "run",
                f"{srv.url}/openapi.json",
                "--checks",
                "all",
                "--exclude-checks",
                "positive_data_acceptance",
                "-H",
                f"Authorization: Bearer {KEY}",
                "--max-examples",
                "30",
                "--generation-deterministic",
                "--request-timeout",
                "120",
                "--max-response-time",
                "120",
                "--no-color",
            ],
            cwd=HERE,
            env={**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks"},
            capture_output=True,
            text=True,
            timeout=1500,
        )
        seconds = time.monotonic() - t0
    out = run.stdout + run.stderr
    m = re.search(r"(\d+) generated, (.*)", out)
    assert m, out[-3000:]
    figures.update(cases=int(m.group(1)), summary=m.group(0).strip(), seconds=round(seconds, 1))
    assert run.returncode == 0, out[-6000:]
    assert int(m.group(1)) >= 1000 and "failure" not in m.group(2) and "errored" not in m.group(2), out[-6000:]
