"""Perplexity of the demo model per weight scheme on held text (not model output): windows of
docs/architecture.md (prose) and HumanEval prompts (code).

    .venv/bin/python benchmarks/eval_quant_ppl.py --window 512 --windows 4

The demo's transformers model with its linears swapped for specfw's ``QuantLinear`` (int8 and
int4 scales are per output row, so quantizing q/k/v or gate/up apart gives the codes of specfw's
fused layers). ``gguf`` is ``none`` bit for bit (tests/engine/test_quant.py), so it is not run again;
``gguf+a8`` (the file's blocks with int8 activations, ``Q8Linear``), ``int8+a8`` and ``int4+a8`` are.
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


def gguf_weights(model) -> dict:
    """Each transformers linear of the demo model -> its GGUF blocks as a ``QuantWeight`` (rows
    matched to the loaded weight exactly, as specfw's loader does)."""
    from gguf import GGUFReader
    from specfw.backends.quant_linear import _match, gguf_blocks
    from specfw.demo_model import demo_gguf_path

    tensors = {t.name: t for t in GGUFReader(str(demo_gguf_path())).tensors}
    cfg = model.config
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names.update({"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"})
    linears = {model.lm_head: "output.weight" if "output.weight" in tensors else "token_embd.weight"}
    for i, layer in enumerate(model.model.layers):
        for mod in (layer.self_attn, layer.mlp):
            for attr, g in names.items():
                if hasattr(mod, attr):
                    linears[getattr(mod, attr)] = f"blk.{i}.{g}.weight"
    out = {}
    for lin, name in linears.items():
        t = tensors[name]
        parts = [(name, gguf_blocks(t.data, t.tensor_type.name, int(t.shape[1]), int(t.shape[0])))]
        qw = _match(lin.weight.detach().float(), parts, cfg.num_attention_heads, cfg.num_key_value_heads)
        assert qw is not None, name
        out[lin] = qw
    return out


def swap_linears(model, scheme: str) -> None:
    """Every linear of ``model`` onto specfw's quantized kernels for ``scheme`` (``+a8``: int8 activations)."""
    from specfw.backends.q8_linear import Q8Linear
    from specfw.backends.quant_linear import QuantLinear, quantize
    from specfw.kernels import q8_ops, quant_ops

    base, _, a8 = scheme.partition("+")
    blocks = gguf_weights(model) if base == "gguf" else {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                qw = blocks[child] if base == "gguf" else quantize(child.weight, base)
                fast = Q8Linear.from_quant_weight(qw, child.bias, q8_ops(), base) if a8 else QuantLinear(qw, child.bias, quant_ops(), base)
                setattr(parent, name, fast)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--schemes", default="none,bf16,int8,int4")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specfw.demo_model import demo_model_dir
    from specfw.machine import cpu_description

    print("CPU:", cpu_description())
    path = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    seqs = texts(tok, args.window, args.windows)
    print(f"{len(seqs)} windows x {args.window} tokens (architecture.md prose, HumanEval code)")
    for scheme in args.schemes.split(","):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if scheme == "bf16" else torch.float32)
        model.eval()
        if scheme not in ("none", "bf16"):
            swap_linears(model, scheme)
        v = nll(model, seqs)
        print(f"{scheme:8s} nll {v:.4f}  perplexity {math.exp(v):.3f}", flush=True)


if __name__ == "__main__":
    main()
