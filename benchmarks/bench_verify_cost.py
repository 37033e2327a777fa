"""Cost of one target forward over T tree rows (one sequence, a draft tree after a prefix), relative
to a one-row decode step: the hardware curve the adaptive draft budget learns online.

    .venv/bin/python benchmarks/bench_verify_cost.py [--prefix 400] [--dtype float32] [--threads 2] [--width 1]

``--width W`` shapes the tree as a root and levels of W nodes (1 = a chain, the worst case for the
batch-invariant attention, which runs one attention call per distinct depth). Prints the curve
with ``engine.batch_invariant`` on (the default) and off, measured interleaved in one run.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm


def level_tree_mask(T: int, width: int) -> torch.Tensor:
    """A root, then levels of ``width`` nodes whose parent is the first node of the level above
    (``width`` 1: a chain)."""
    mask = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        parent = 0 if i <= width else 1 + ((i - 1) // width - 1) * width
        mask[i] |= mask[parent]
    return mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=400)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--no-packed-gemm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.model_runner import build_forward_batch

    runners = {}
    for invariant in (True, False):
        eng = Engine(SpecfwConfig(model=ModelConfig(dtype=args.dtype), speculative=SpeculativeConfig(),
                                  engine=EngineConfig(num_threads=args.threads, cpu_packed_gemm=not args.no_packed_gemm,
                                                      batch_invariant=invariant, max_total_tokens=args.prefix + 64)))
        runners[invariant] = (eng.runner, eng.runner.allocator.alloc(args.prefix))
    sizes = list(range(1, 17)) + [24, 32]
    best: dict[tuple[bool, int], float] = {}
    for _ in tqdm(range(args.reps), desc="sweeps"):
        for T in sizes:
            mask = level_tree_mask(T, args.width) if T > 1 else None
            ids = torch.randint(0, 1000, (T,))
            depth = mask.sum(1) - 1 if mask is not None else torch.zeros(1, dtype=torch.long)
            for invariant, (runner, prefix) in runners.items():
                slots = runner.allocator.alloc(T)
                chunk = [(ids, args.prefix + depth, slots, prefix, mask)]
                runner.forward(build_forward_batch(chunk))
                t0 = time.perf_counter()
                for _ in range(5):
                    runner.forward(build_forward_batch(chunk))
                key = (invariant, T)
                best[key] = min(best.get(key, float("inf")), (time.perf_counter() - t0) / 5)
                runner.allocator.free(slots)
    print(f"\nforward cost by tree rows ({args.dtype}, {args.threads} threads, prefix {args.prefix}, "
          f"tree levels of {args.width}, packed GEMM {'off' if args.no_packed_gemm else 'on'})")
    print("rows   batch_invariant=true      batch_invariant=false")
    for T in sizes:
        a, b = best[(True, T)], best[(False, T)]
        print(f"{T:4d}   {a * 1e3:7.2f} ms {a / best[(True, 1)]:5.2f}x     {b * 1e3:7.2f} ms {b / best[(False, 1)]:5.2f}x")


if __name__ == "__main__":
    main()
