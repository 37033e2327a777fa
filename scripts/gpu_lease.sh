#!/usr/bin/env bash
# Prepare (and undo) what this workplace's device machine needs to run the GPU check on the demo
# model's real weights (docs/gpu.md, "On this workplace's device machine"). A lease carries the
# tracked tree plus at most 64 MiB; the demo GGUF (94 MB, 90 MB xz) therefore travels in two
# calls: .gpu1 (wheels, the demo tokenizer/config, the first 44 MB) and .gpu2 (the rest, the
# converter). The three drafts the GPU check does not use (standalone, mtp, eagle: 34 MB) leave
# the index while the lease runs, so that the tree is 17 MB.
#   scripts/gpu_lease.sh prep       # builds .gpu1 .gpu2 (ignored), untracks the unused drafts
#   scripts/gpu_lease.sh restore    # puts them back in the index (run it before any commit)
set -euo pipefail
cd "$(dirname "$0")/.."
UNUSED="plugins/standalone/demo_draft/model.safetensors.xz plugins/standalone/demo_draft/tokenizer.json.xz plugins/mtp/demo_draft/model.safetensors.xz plugins/eagle/demo_draft/model.safetensors.xz"
EXCLUDE=.git/info/exclude
PY=${PYTHON:-.venv/bin/python}
case "${1:-}" in
prep)
  mkdir -p .gpu1/tok .gpu2/tok
  for d in /.gpu1/ /.gpu2/; do grep -qxF "$d" "$EXCLUDE" || echo "$d" >>"$EXCLUDE"; done
  # what the device image lacks (docs/gpu.md); antlr4 4.9.3 is an sdist: built here, pure Python
  P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any"
  "$PY" -m pip download -q $P -d .gpu1 omegaconf==2.3.1 hydra-core==1.3.8 gguf==0.19.0 nvidia_mtbench_evaluator==26.3
  "$PY" -m pip wheel -q --no-deps -w .gpu1 antlr4-python3-runtime==4.9.3
  demo=$("$PY" -c "from specfw.demo_model import demo_model_dir; print(demo_model_dir())")
  gguf=$("$PY" -c "from specfw.demo_model import demo_gguf_path; print(demo_gguf_path())")
  for f in chat_template.jinja config.json generation_config.json specfw_converted.json tokenizer_config.json; do cp "$demo/$f" .gpu1/tok/; done
  xz -c "$demo/tokenizer.json" >.gpu1/tok/tokenizer.json.xz
  cp .gpu1/tok/* .gpu2/tok/
  tmp=$(mktemp -d)
  xz -T2 -6 -c "$gguf" >"$tmp/model.gguf.xz"
  sha256sum "$tmp/model.gguf.xz" | cut -c1-64 >.gpu2/sha256
  split -b 44000000 -d "$tmp/model.gguf.xz" "$tmp/part."
  mv "$tmp/part.00" .gpu1/ && mv "$tmp"/part.0[1-9] .gpu2/ && rm -rf "$tmp"
  cp scripts/gpu_demo_convert.py .gpu2/convert.py
  "$PY" -c "
import json; from safetensors.torch import load_file
sd = load_file('$demo/model.safetensors')
json.dump({k: float(v.double().abs().sum()) for k, v in sd.items()}, open('.gpu2/fingerprint.json', 'w'))"
  git rm -q --cached $UNUSED
  for f in $UNUSED; do grep -qxF "/$f" "$EXCLUDE" || echo "/$f" >>"$EXCLUDE"; done
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1)
  for c in .gpu1 .gpu2; do
    echo "call with carry [$c]: $(((tree + $(du -sb $c | cut -f1)) / 1048576)) MiB of 64"
  done
  echo "now run the two device calls of docs/gpu.md back to back, then: scripts/gpu_lease.sh restore"
  ;;
restore)
  git reset -q -- $UNUSED
  for f in $UNUSED; do sed -i "\#^/$f\$#d" "$EXCLUDE"; done
  git status --short -- $UNUSED
  ;;
*)
  echo "usage: $0 prep|restore" >&2
  exit 2
  ;;
esac
