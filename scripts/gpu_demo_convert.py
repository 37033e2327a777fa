"""On the device machine of a lease (scripts/gpu_lease.sh, docs/gpu.md): the demo GGUF, reassembled
there, into specfw's cached safetensors directory, with the tokenizer and config files converted
here (so the device's older transformers converts the weights only), and a check that every
tensor's sum of magnitudes equals the one computed here.

    python scripts/gpu_demo_convert.py GGUF OUT_DIR TOK_DIR     # TOK_DIR/../fingerprint.json: the sums
"""

from __future__ import annotations

import json
import lzma
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specfw.demo_model import _save_safetensors


def main() -> int:
    gguf, out, tok = (Path(a) for a in sys.argv[1:4])
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    _save_safetensors(model, out)
    for f in tok.iterdir():  # after the weights: these files replace the config save_pretrained wrote
        if f.suffix == ".xz":
            (out / f.stem).write_bytes(lzma.decompress(f.read_bytes()))
        else:
            shutil.copy(f, out / f.name)
    ref = json.loads((tok.parent / "fingerprint.json").read_text())
    state = {k: float(v.double().abs().sum()) for k, v in model.state_dict().items()}
    bad = [k for k, r in ref.items() if k not in state or abs(state[k] - r) > 1e-6 * max(1.0, r)]
    print(f"converted: {len(state)} tensors; " + ("fingerprint OK" if not bad else f"fingerprint MISMATCH in {bad[:5]}"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
