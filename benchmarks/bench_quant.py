"""Quantized weights on the demo model, beside llama.cpp on the same GGUF file, one run.

    .venv/bin/python benchmarks/bench_quant.py --dataset mtbench --n 16 --schemes none,int8,int4,gguf \
        --algo ngram --llama-cpp
    .venv/bin/python benchmarks/bench_quant.py --verify-cost     # 1/8/16-row forward cost per scheme

A scheme with ``+a8`` (``gguf+a8``, ``int8+a8``, ``int4+a8``) runs with
``model.activation_quantization=int8`` (int8 activations, integer dot products).

Per scheme: plain greedy tokens/s (batch 1, same prompts and threads for every row), the share of
outputs identical to the unquantized model's and their mean common-prefix length; per ``--algo``:
speculative tokens/s on top of the scheme and whether every output equals that scheme's own plain
greedy. ``--llama-cpp``: llama-cpp-python (optional extra ``bench-llama``) plain and with its
prompt lookup on the demo's GGUF file, the same prompt token ids, greedy, the same threads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec import load_prompts, parse_algo  # noqa: E402


def engine_for(scheme: str, spec=None, threads: int = 2):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine

    dtype = "bfloat16" if scheme == "bf16" else "float32"
    scheme, _, a8 = scheme.partition("+")  # "gguf+a8": the scheme's weights with int8 activations
    quant = "none" if scheme in ("none", "bf16") else scheme
    return Engine(
        SpecfwConfig(
            model=ModelConfig(dtype=dtype, quantization=quant, activation_quantization="int8" if a8 == "a8" else "none"),
            engine=EngineConfig(max_total_tokens=8192, max_running_requests=1, num_threads=threads),
            speculative=spec or SpeculativeConfig(),
        )
    )


def timed(generate, prompts):
    outs, n, t = [], 0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        o = generate(p)
        t += time.perf_counter() - t0
        n += len(o)
        outs.append(o)
    return n / t, outs


def prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def llama_cpp_rows(prompts, max_new: int, threads: int) -> list[dict]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from specfw.demo_model import demo_gguf_path

    rows = []
    for label, draft in [("llama.cpp plain", None), ("llama.cpp prompt lookup (10)", LlamaPromptLookupDecoding(num_pred_tokens=10))]:
        llm = Llama(str(demo_gguf_path()), n_threads=threads, n_threads_batch=threads, n_ctx=4096, verbose=False, draft_model=draft)

        def gen(p):
            llm.reset()
            out = []
            for tok in llm.generate(p, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                out.append(tok)
                if len(out) >= max_new or tok == llm.token_eos():
                    break
            return out

        gen(prompts[0][:8])
        tps, outs = timed(gen, prompts)
        rows.append({"row": label, "tok_s": round(tps, 1), "outputs": outs})
    return rows


def verify_cost(schemes, threads: int):
    """Forward of 1/8/16 rows through every quantized linear of the demo model (no attention)."""
    from specfw.backends.kernel_linear import KernelLinear
    from specfw.backends.q8_linear import Q8Linear
    from specfw.backends.quant_linear import QuantLinear

    for scheme in schemes:
        eng = engine_for(scheme, threads=threads)
        lins = [m for m in eng.runner.model.modules() if isinstance(m, (KernelLinear, QuantLinear, Q8Linear))]
        times = {}
        for rows in (1, 8, 16):
            xs = {m.in_features: torch.randn(rows, m.in_features) for m in lins}
            for _ in range(3):
                for m in lins:
                    m(xs[m.in_features])
            t0 = time.perf_counter()
            for _ in range(10):
                for m in lins:
                    m(xs[m.in_features])
            times[rows] = (time.perf_counter() - t0) / 10 * 1e3
        print(
            f"{scheme:8s} linears per forward: " + ", ".join(f"{r} rows {t:.1f} ms" for r, t in times.items()) + f"  (16/1 = {times[16] / times[1]:.2f}x)",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="mtbench", choices=["mtbench", "humaneval"])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--schemes", default="none,bf16,int8,int4,gguf")
    ap.add_argument("--algo", action="append", default=[], help="speculative algorithm[:k=v,...] on top of each scheme")
    ap.add_argument("--algo-schemes", default="gguf", help="schemes the --algo rows run on")
    ap.add_argument("--llama-cpp", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specfw.machine import cpu_description
    from specfw.plugins import plugin_manager
    from specfw.sampling import SamplingParams

    print("CPU:", cpu_description(), flush=True)
    schemes = args.schemes.split(",")
    if args.verify_cost:
        verify_cost([s for s in schemes if s != "bf16"], args.threads)
        return
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    rows, plain = [], {}
    prompts = None
    for scheme in schemes:
        eng = engine_for(scheme, threads=args.threads)
        prompts = prompts or load_prompts(args.dataset, args.n, eng)
        eng.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0))
        tps, outs = timed(lambda p: eng.generate([p], params)[0].token_ids, prompts)
        plain[scheme] = outs
        rows.append({"row": f"specfw {scheme} plain", "tok_s": round(tps, 1), "outputs": outs})
        print(f"specfw {scheme:5s} plain: {tps:.1f} tok/s  ({eng.backend.describe()})", flush=True)
        del eng
    for scheme in args.algo_schemes.split(","):
        for spec_s in args.algo:
            name, kw = parse_algo(spec_s)
            spec = plugin_manager().algorithms[name].config_class(algorithm=name, **kw)
            eng = engine_for(scheme, spec, args.threads)
            eng.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0))
            tps, outs = timed(lambda p: eng.generate([p], params)[0].token_ids, prompts)
            exact = outs == plain.get(scheme)
            rows.append({"row": f"specfw {scheme} {spec_s}", "tok_s": round(tps, 1), "outputs": outs, "exact": exact})
            print(f"specfw {scheme} {spec_s}: {tps:.1f} tok/s, == its plain greedy: {exact}", flush=True)
            del eng
    if args.llama_cpp:
        for r in llama_cpp_rows(prompts, args.max_new_tokens, args.threads):
            rows.append(r)
            print(f"{r['row']}: {r['tok_s']:.1f} tok/s", flush=True)
    ref = plain.get("none")
    print(f"\n{args.dataset} x {len(prompts)} prompts x {args.max_new_tokens}, batch 1, {args.threads} threads")
    base = next((r["tok_s"] for r in rows if r["row"] == "llama.cpp plain"), None)
    for r in rows:
        q = ""
        if ref is not None:
            same = sum(a == b for a, b in zip(r["outputs"], ref))
            q = f"identical to none {same}/{len(ref)}, mean common prefix {sum(prefix(a, b) for a, b in zip(r['outputs'], ref)) / len(ref):.1f}"
        vs = f"{r['tok_s'] / base:.2f}x llama.cpp" if base else ""
        print(f"  {r['row']:40s} {r['tok_s']:7.1f} tok/s  {vs:16s} {q}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
