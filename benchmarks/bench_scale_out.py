"""Scale-out on one machine, in one run (issue 22): tensor parallelism (TP=1 vs TP=2 ranks, the same
threads in total) and data-parallel replicas (1 vs 2 ``specfw serve`` behind sglang-router via
``specfw cluster``, the same threads in total), on MT-bench first turns, greedy.

    .venv/bin/python benchmarks/bench_scale_out.py [--prompts 24] [--max-new-tokens 64] [--concurrency 16]
        [--threads 2] [--quantization none] [--skip-replicas]

TP=2 runs twice: ``model.tp_backend=gloo`` (every collective over loopback TCP) and ``auto`` (spawned
ranks all-gather through shared memory). Prints the CPU, then per setting tokens/s at batch 1 (TP only) and at ``--concurrency`` requests in
flight, and how many TP=2 greedy outputs equal TP=1's (the partial sums of o_proj/down_proj are
added in another order, so bits may differ) with their mean common-prefix length.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm


def engine_run(args, tp: int, prompts_text: list[str], tp_backend: str = "auto"):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams

    act = "int8" if args.quantization != "none" else "none"
    cfg = SpecfwConfig(
        model=ModelConfig(tp_size=tp, tp_backend=tp_backend, quantization=args.quantization, activation_quantization=act),
        engine=EngineConfig(max_running_requests=args.concurrency, num_threads=args.threads),
        speculative=SpeculativeConfig(),
    )
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, ignore_eos=True)
    with Engine(cfg) as eng:
        prompts = [eng.tokenize_chat([{"role": "user", "content": q}]) for q in prompts_text]
        eng.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
        t0, single = time.perf_counter(), []
        for p in tqdm(prompts, desc=f"TP={tp} {tp_backend} batch 1", leave=False):
            single.append(eng.generate([p], greedy)[0].token_ids)
        t1 = time.perf_counter()
        batched = eng.generate(prompts, greedy)
        t2 = time.perf_counter()
    n1, n2 = sum(map(len, single)), sum(len(o.token_ids) for o in batched)
    return single, n1 / (t1 - t0), n2 / (t2 - t1)


def cluster_run(args, replicas: int, prompts_text: list[str]) -> float:
    import openai

    port = 31000 + 10 * replicas
    exe = os.path.join(os.path.dirname(sys.executable), "specfw")
    extra = [f"model.quantization={args.quantization}"] + (["model.activation_quantization=int8"] if args.quantization != "none" else [])
    cmd = [exe, "cluster", f"replicas={replicas}", f"port={port}", "policy=round_robin", f"engine.num_threads={args.threads // replicas}"] + extra
    cmd += [f"engine.max_running_requests={args.concurrency}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("cluster ready"):
                break
        else:
            raise RuntimeError(f"specfw cluster replicas={replicas} did not start")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=2, timeout=600)

        def ask(q):
            r = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": q}], max_tokens=args.max_new_tokens, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.usage.completion_tokens

        ask(prompts_text[0])  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(tqdm(pool.map(ask, prompts_text), total=len(prompts_text), desc=f"{replicas} replica(s)", leave=False))
        return tokens / (time.perf_counter() - t0)
    finally:
        proc.send_signal(2)
        proc.wait(60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--skip-replicas", action="store_true")
    args = ap.parse_args()
    import torch

    from specfw.datasets import mtbench_first_turns
    from specfw.machine import cpu_description

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}")
    setup = f"MT-bench {args.prompts} first turns x {args.max_new_tokens} tokens, greedy, {args.threads} threads in total"
    print(f"demo target, {args.quantization} weights, {setup}")
    prompts = mtbench_first_turns(args.prompts)
    one, one_b1, one_bn = engine_run(args, 1, prompts)
    _, gloo_b1, gloo_bn = engine_run(args, 2, prompts, "gloo")
    two, two_b1, two_bn = engine_run(args, 2, prompts)
    same = sum(a == b for a, b in zip(one, two))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in zip(one, two)]
    print(f"\n| setting | batch 1 tok/s | {args.concurrency} in flight tok/s |\n|---|---|---|")
    print(f"| TP=1 ({args.threads} threads) | {one_b1:.1f} | {one_bn:.1f} |")
    per_rank = f"{args.threads // 2} thread(s) per rank"
    print(f"| TP=2 ({per_rank}, tp_backend=gloo) | {gloo_b1:.1f} ({gloo_b1 / one_b1:.2f}x) | {gloo_bn:.1f} ({gloo_bn / one_bn:.2f}x) |")
    print(f"| TP=2 ({per_rank}, tp_backend=auto: shared memory) | {two_b1:.1f} ({two_b1 / one_b1:.2f}x) | {two_bn:.1f} ({two_bn / one_bn:.2f}x) |")
    if not args.skip_replicas:
        r1 = cluster_run(args, 1, prompts)
        r2 = cluster_run(args, 2, prompts)
        print(f"| 1 replica behind sglang-router ({args.threads} threads) | | {r1:.1f} |")
        print(f"| 2 replicas behind sglang-router ({args.threads // 2} thread(s) each) | | {r2:.1f} ({r2 / r1:.2f}x) |")
    print(f"\nTP=2 vs TP=1 greedy outputs: {same}/{len(one)} identical, mean common prefix {sum(prefix) / len(prefix):.1f} of {args.max_new_tokens} tokens")


if __name__ == "__main__":
    main()
