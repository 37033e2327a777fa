"""Perplexity of the demo model per weight scheme on held text (not model output): windows of
docs/architecture.md (prose) and HumanEval prompts (code).

    .venv/bin/python benchmarks/eval_quant_ppl.py --window 512 --windows 4

The demo's transformers model with its linears swapped for specfw's ``QuantLinear`` (int8 and
int4 scales are per output row, so quantizing q/k/v or gate/up apart gives the codes of specfw's
fused layers). ``gguf`` is ``none`` bit for bit (tests/engine/test_quant.py), so it is not run again.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch


def texts(tok, window: int, windows: int):
    from specfw.datasets import humaneval_prompts

    prose = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    code = "\n".join(humaneval_prompts(40))
    out = []
    for text in (prose, code):
        ids = tok(text)["input_ids"]
        out += [ids[i * window : (i + 1) * window] for i in range(windows // 2) if len(ids) >= (i + 1) * window]
    return out


def nll(model, seqs) -> float:
    total, n = 0.0, 0
    with torch.inference_mode():
        for ids in seqs:
            x = torch.tensor([ids])
            logits = model(x).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            n += len(ids) - 1
    return total / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--schemes", default="none,bf16,int8,int4")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specfw.backends.quant_linear import QuantLinear
    from specfw.demo_model import demo_model_dir
    from specfw.kernels import quant_ops
    from specfw.machine import cpu_description

    print("CPU:", cpu_description())
    path = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    seqs = texts(tok, args.window, args.windows)
    print(f"{len(seqs)} windows x {args.window} tokens (architecture.md prose, HumanEval code)")
    for scheme in args.schemes.split(","):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if scheme == "bf16" else torch.float32)
        model.eval()
        if scheme in ("int8", "int4"):
            ops = quant_ops()
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if type(child) is torch.nn.Linear:
                        setattr(parent, name, QuantLinear.from_linear(child, ops, scheme))
        v = nll(model, seqs)
        print(f"{scheme:5s} nll {v:.4f}  perplexity {math.exp(v):.3f}", flush=True)


if __name__ == "__main__":
    main()
