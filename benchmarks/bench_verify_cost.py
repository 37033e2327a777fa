"""Cost of one target forward over T tree rows (one sequence, a draft tree after a prefix), relative
to a one-row decode step: the hardware curve the adaptive draft budget learns online.

    .venv/bin/python benchmarks/bench_verify_cost.py [--prefix 400] [--dtype float32] [--threads 2] [--width 1]

``--width W`` shapes the tree as a root and levels of W nodes (1 = a chain, the worst case for the
batch-invariant attention, which runs one attention call per distinct depth). Prints the curve
for three settings measured interleaved in one run: specfw's CPU kernels (``engine.cpu_isa``,
default auto; exact by construction), torch's ops batch invariant (``engine.cpu_isa=none``: row
plans, one-row SDPA calls) and torch's ops loose (``batch_invariant=false``: masked tree attention).
``--isa avx2`` forces the kernels' AVX2 build (on an AVX-512 CPU too). ``--greedy`` runs the
forwards as greedy verification runs them (``ForwardBatch.greedy_only``: only each row's argmax
and its logit are exact; an fp32 lm_head goes through ``GreedyHead``); without it every row gets
full logits (what sampled requests pay).

``--quantization gguf --activations int8`` (the demo's own blocks, int8 activations: the fastest
exact setup) times the kernels only; on a CPU with AMX-INT8 it times the backend as it runs (q8_ops'
amx build for calls of 16+ rows, its avx512 build below) against the avx512 build for every call
(vpdpbusd), interleaved.
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


def alternate_forwards(runner, use, sizes: list[int], rounds: int, prefix: int) -> dict[int, list[float]]:
    """Two kernel builds driving one runner's target forwards in turn (``use("base")`` /
    ``use("new")`` switches them): per row count (a chain of tree rows after a prefix, greedy), the
    per-round time ratios new / base, rounds alternating which goes first. Stops if the two builds'
    hidden states differ."""
    from specfw.model_runner import build_forward_batch

    pre = runner.allocator.alloc(prefix)
    out = {T: [] for T in sizes}
    for r in tqdm(range(rounds), desc="forwards"):
        for T in sizes:
            mask = level_tree_mask(T, 1) if T > 1 else None
            depth = mask.sum(1) - 1 if mask is not None else torch.zeros(1, dtype=torch.long)
            ids = torch.randint(0, 1000, (T,))
            t, hidden = {}, {}
            for name in ["base", "new"] if r % 2 == 0 else ["new", "base"]:
                use(name)
                slots = runner.allocator.alloc(T)
                chunk = [(ids, prefix + depth, slots, pre, mask)]
                hidden[name] = runner.forward(build_forward_batch(chunk, greedy_only=True)).hidden.clone()
                t0 = time.perf_counter()
                for _ in range(5):
                    runner.forward(build_forward_batch(chunk, greedy_only=True))
                t[name] = (time.perf_counter() - t0) / 5
                runner.allocator.free(slots)
            if not torch.equal(hidden["base"], hidden["new"]):
                raise SystemExit(f"the builds' forwards differ at {T} rows")
            out[T].append(t["new"] / t["base"])
    runner.allocator.free(pre)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=400)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--no-packed-gemm", action="store_true")
    ap.add_argument("--isa", default="auto", help="engine.cpu_isa of the kernel row (auto|avx512|avx2|portable)")
    ap.add_argument("--quantization", default="none", help="model.quantization (none|int8|int4|gguf)")
    ap.add_argument("--activations", default="none", help="model.activation_quantization (none|int8|int8_per_token)")
    ap.add_argument("--greedy", action="store_true", help="greedy_only forwards, as greedy verification runs them")
    ap.add_argument("--sizes", default="", help="comma-separated tree sizes (default 1-16, 24, 32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.model_runner import build_forward_batch

    from specfw.machine import cpu_description

    from specfw import kernels

    quantized = args.quantization != "none"
    settings = {"kernels": (args.isa, True), "torch exact": ("none", True), "torch loose": ("none", False)}
    if quantized:
        settings = {"kernels": (args.isa, True)}
        if args.activations == "int8" and kernels.q8_isa(kernels.cpu_isa(None if args.isa == "auto" else args.isa)) == "amx":
            settings["kernels, no AMX tiles"] = (args.isa, True)
    runners = {}
    for name, (isa, invariant) in settings.items():
        q8_isa = kernels.q8_isa
        if name == "kernels, no AMX tiles":  # the backend gets no amx build: the avx512 one (vpdpbusd) for every call
            kernels.q8_isa = lambda isa=None: "avx512"
        eng = Engine(
            SpecfwConfig(
                model=ModelConfig(dtype=args.dtype, quantization=args.quantization, activation_quantization=args.activations),
                speculative=SpeculativeConfig(),
                engine=EngineConfig(
                    num_threads=args.threads, cpu_packed_gemm=not args.no_packed_gemm, cpu_isa=isa, batch_invariant=invariant, max_total_tokens=args.prefix + 64
                ),
            )
        )
        kernels.q8_isa = q8_isa
        runners[name] = (eng.runner, eng.runner.allocator.alloc(args.prefix))
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(range(1, 17)) + [24, 32]
    best: dict[tuple[bool, int], float] = {}
    for _ in tqdm(range(args.reps), desc="sweeps"):
        for T in sizes:
            mask = level_tree_mask(T, args.width) if T > 1 else None
            ids = torch.randint(0, 1000, (T,))
            depth = mask.sum(1) - 1 if mask is not None else torch.zeros(1, dtype=torch.long)
            for name, (runner, prefix) in runners.items():
                slots = runner.allocator.alloc(T)
                chunk = [(ids, args.prefix + depth, slots, prefix, mask)]
                runner.forward(build_forward_batch(chunk, greedy_only=args.greedy))
                t0 = time.perf_counter()
                for _ in range(5):
                    runner.forward(build_forward_batch(chunk, greedy_only=args.greedy))
                key = (name, T)
                best[key] = min(best.get(key, float("inf")), (time.perf_counter() - t0) / 5)
                runner.allocator.free(slots)
    print(
        f"\nforward cost by tree rows ({args.dtype}, quantization {args.quantization}, activations {args.activations}, "
        f"prefix {args.prefix}, tree levels of {args.width}, {'greedy-only' if args.greedy else 'full'} logits, "
        f"kernels {runners['kernels'][0].backend.describe()})\non {cpu_description()}"
    )
    print("rows " + "".join(f"{name:>22s}" for name in runners))
    for T in sizes:
        print(f"{T:4d} " + "".join(f"{best[(n, T)] * 1e3:10.2f} ms {best[(n, T)] / best[(n, 1)]:5.2f}x  " for n in runners))


if __name__ == "__main__":
    main()
