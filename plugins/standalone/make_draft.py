"""Make an untrained standalone draft by truncating a Llama-family target to its first layers
(shares the tokenizer; useful for tests and as a baseline — `specfw train draft=standalone`
distils a much better one).

    python -m specfw_plugins.standalone.make_draft OUT_DIR [--layers 4] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def truncate_model(src: Path, out: Path, layers: int) -> Path:
    from safetensors.torch import save_file
    from specfw.sdk import load_state_dict

    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"--layers must be in 1..{cfg['num_hidden_layers']}, got {layers}")
    state = load_state_dict(src)
    keep = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in keep.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def main():
    from specfw.sdk import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", default=None, help="target (default: the demo model)")
    args = ap.parse_args()
    print(truncate_model(resolve_model_path(args.model), args.out, args.layers))


if __name__ == "__main__":
    main()
