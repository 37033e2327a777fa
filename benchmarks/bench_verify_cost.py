"""Cost of one target forward over T tree rows (one sequence, causal tree after a prefix), relative
to a one-row decode step: the hardware curve the adaptive draft budget learns online.

    .venv/bin/python benchmarks/bench_verify_cost.py [--prefix 400] [--dtype float32] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=400)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-packed-gemm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.model_runner import build_forward_batch

    eng = Engine(SpecfwConfig(model=ModelConfig(dtype=args.dtype), speculative=SpeculativeConfig(),
                              engine=EngineConfig(num_threads=args.threads, cpu_packed_gemm=not args.no_packed_gemm)))
    runner = eng.runner
    prefix = runner.allocator.alloc(args.prefix)
    sizes = list(range(1, 17)) + [24, 32]
    best: dict[int, float] = {}
    for _ in tqdm(range(args.reps), desc="sweeps"):
        for T in sizes:
            slots = runner.allocator.alloc(T)
            mask = torch.ones(T, T, dtype=torch.bool).tril() if T > 1 else None
            chunk = [(torch.randint(0, 1000, (T,)), torch.arange(args.prefix, args.prefix + T), slots, prefix, mask)]
            runner.forward(build_forward_batch(chunk))
            t0 = time.perf_counter()
            for _ in range(5):
                runner.forward(build_forward_batch(chunk))
            best[T] = min(best.get(T, float("inf")), (time.perf_counter() - t0) / 5)
            runner.allocator.free(slots)
    print(f"\nforward cost by tree rows ({args.dtype}, {args.threads} threads, prefix {args.prefix}, "
          f"packed GEMM {'off' if args.no_packed_gemm else 'on'})")
    for T in sizes:
        print(f"{T:3d} rows: {best[T] * 1e3:7.2f} ms  {best[T] / best[1]:5.2f}x one row")


if __name__ == "__main__":
    main()
