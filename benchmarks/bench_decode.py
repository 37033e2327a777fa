"""Decode throughput: specfw vs HF transformers `generate` (batch 1), and specfw at 8
concurrent requests vs batch 1. Same prompts, same thread count, one run; prints ratios.

    .venv/bin/python benchmarks/bench_decode.py [--prompts 8] [--new-tokens 128] [--threads 2] [--dtype bfloat16]

specfw runs with the engine defaults (``engine.batch_invariant=true``); ``--compare-invariant``
adds the same two specfw rows with ``batch_invariant=false`` (what exactness costs);
``--compare-torch-ops`` adds them with ``engine.cpu_isa=none`` (torch's MKL/oneDNN ops instead of
specfw's CPU kernels: the engine before the kernel backend). ``--isa avx2`` forces the kernels'
AVX2 build. The header names the CPU.
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto", help="model.device: auto | cpu | cuda | cuda:N")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--compare-invariant", action="store_true", help="also time specfw with engine.batch_invariant=false")
    ap.add_argument("--compare-torch-ops", action="store_true", help="also time specfw with engine.cpu_isa=none")
    ap.add_argument("--isa", default="auto", help="engine.cpu_isa of the main rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams

    def build(invariant: bool, isa: str = args.isa) -> Engine:
        return Engine(
            SpecfwConfig(
                model=ModelConfig(dtype=args.dtype, device=args.device),
                speculative=SpeculativeConfig(),
                engine=EngineConfig(max_running_requests=args.concurrency, num_threads=args.threads, batch_invariant=invariant, cpu_isa=isa),
            )
        )

    eng = build(True)
    prompts = [eng.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(eng.model_path, dtype=getattr(torch, args.dtype)).eval()

    eng.generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=0))  # warm-up
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)

    def run_hf():
        n, t = 0, 0.0
        for p in tqdm(prompts, desc="HF generate (batch 1)"):
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([p]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=eng.tokenizer.eos_token_id
                )
            t += time.perf_counter() - t0
            n += out.shape[1] - len(p)
        return n / t

    def run_specfw_b1(eng):
        n, t = 0, 0.0
        for p in tqdm(prompts, desc="specfw (batch 1)"):
            t0 = time.perf_counter()
            n += len(eng.generate([p], params)[0].token_ids)
            t += time.perf_counter() - t0
        return n / t

    def run_specfw_concurrent(eng):
        t0 = time.perf_counter()
        outs = eng.generate(prompts[: args.concurrency] * max(1, args.concurrency // len(prompts)), params, progress=True)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    hf_tps = run_hf()
    b1 = run_specfw_b1(eng)
    bn = run_specfw_concurrent(eng)
    kernels = eng.backend.describe()
    if args.compare_torch_ops:
        del eng
        eng = build(True, "none")
        eng.generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=0))
        b1_torch, bn_torch = run_specfw_b1(eng), run_specfw_concurrent(eng)
    if args.compare_invariant:
        del eng
        loose = build(False)
        loose.generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=0))
        b1_loose, bn_loose = run_specfw_b1(loose), run_specfw_concurrent(loose)
    from specfw.machine import cpu_description

    print(f"\nSmolLM2-135M-Instruct {args.dtype}, {args.threads} threads, {len(prompts)} MT-bench prompts x {args.new_tokens} new tokens")
    print(f"on {cpu_description()}; kernels: {kernels}")
    print(f"HF transformers generate, batch 1 : {hf_tps:8.2f} tok/s")
    print(f"specfw, batch 1                   : {b1:8.2f} tok/s   ratio vs HF: {b1 / hf_tps:.2f}x (target >= 1.3x)")
    print(f"specfw, {args.concurrency} concurrent requests     : {bn:8.2f} tok/s   ratio vs batch 1: {bn / b1:.2f}x (target >= 4x)")
    if args.compare_torch_ops:
        print(f"torch ops (cpu_isa=none), batch 1 : {b1_torch:8.2f} tok/s   ratio vs HF: {b1_torch / hf_tps:.2f}x; kernels/torch ops {b1 / b1_torch:.2f}x")
        print(f"torch ops, {args.concurrency} concurrent        : {bn_torch:8.2f} tok/s   kernels/torch ops {bn / bn_torch:.2f}x")
    if args.compare_invariant:
        print(f"batch_invariant=false, batch 1    : {b1_loose:8.2f} tok/s   ratio vs HF: {b1_loose / hf_tps:.2f}x; invariant/loose {b1 / b1_loose:.2f}x")
        print(f"batch_invariant=false, {args.concurrency} concurrent: {bn_loose:8.2f} tok/s   invariant/loose {bn / bn_loose:.2f}x")


if __name__ == "__main__":
    main()
