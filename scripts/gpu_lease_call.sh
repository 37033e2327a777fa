#!/usr/bin/env bash
# The two device calls of a GPU lease (docs/gpu.md, "On this workplace's device machine"), run on
# the device machine from the repository root after `scripts/gpu_lease.sh prep` here:
#   call 1, carry [".gpu1"]:  bash scripts/gpu_lease_call.sh 1     # install, the GGUF's first part, the CUDA tests
#   call 2, carry [".gpu2"]:  bash scripts/gpu_lease_call.sh 2     # the GGUF reassembled and converted, the benchmark
# Knobs (environment): TESTS=0 skips call 1's tests; TESTS_S (150) bounds them; BENCH_S (260)
# bounds call 2's benchmark, BENCH_ARGS replaces its arguments after --out (default: triton with
# CUDA graphs, batch 1, plain / eagle3 chains / auto shape / ngram, a 200 s deadline).
# Call 2 needs call 1's /tmp on the same warm machine (it goes back ~30 s after a call).
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 SPECFW_CACHE_DIR=/tmp/sc TRITON_INTERPRET=0 PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
D=/tmp/sc/models/SmolLM2-135M-Instruct
case "${1:-}" in
1)
  nvidia-smi -L
  grep -m1 "model name" /proc/cpuinfo
  mkdir -p /tmp/parts && cp .gpu1/part.00 /tmp/parts/
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu1/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
  mkdir -p $D && cp .gpu1/tok/* $D/
  python3 -c "import lzma; open('$D/tokenizer.json', 'wb').write(lzma.open('$D/tokenizer.json.xz').read())"
  [ "${TESTS:-1}" = 0 ] && exit 0
  timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider --timeout 90 -rfEs tests/unit/test_triton_tree_ops.py \
    tests/unit/test_attention_backends.py tests/unit/test_triton_attention.py tests/unit/test_triton_kv_ops.py tests/engine/test_gpu.py \
    2>&1 | tee "$OUT/pytest.log" | tail -25
  ;;
2)
  cat /tmp/parts/part.00 .gpu2/part.0[1-9] >/tmp/m.xz && echo "$(cat .gpu2/sha256)  /tmp/m.xz" | sha256sum -c || exit 3
  mkdir -p /tmp/g
  python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('/tmp/m.xz'), open('/tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf', 'wb'))"
  rm -rf $D && python3 .gpu2/convert.py /tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf $D .gpu2/tok || exit 4
  # shellcheck disable=SC2086
  timeout "${BENCH_S:-260}" python3 benchmarks/bench_gpu.py --out "$OUT" ${BENCH_ARGS:---prompts 16 --backends triton --no-eager --batch-sizes 1 --deadline-s 200 --algos plain,eagle3-3-1-4,eagle3-5-1-6,eagle3-auto,ngram} \
    2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -30
  ;;
*)
  echo "usage: $0 1|2 (see the header)" >&2
  exit 2
  ;;
esac
