"""Named engine configurations side by side in one process: every round runs the same prompts
through each engine in turn (engines stay warm, their adaptive policies keep learning; what
drafters learned from the tokens of earlier rounds is flushed before each round: the n-gram trie
would otherwise know the answers), so a machine whose speed drifts 10-30% within minutes drifts
for all of them alike. Prints tok/s per
round, each configuration's median and its ratio to the first (``plain``), and checks every
greedy output equals the plain engine's.

    .venv/bin/python benchmarks/bench_side_by_side.py --dataset mtbench --start 40 --n 24 --rounds 2 \\
        plain= eagle=algorithm=eagle "eagle full=algorithm=eagle,token_map=full"

A configuration is ``name=key=value,key=value`` over the speculative keys (``algorithm`` first;
nothing after the name = plain decoding). ``--dtype``, ``--batch`` (requests in flight) and
``--max-new-tokens`` apply to all.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import time

import torch
from tqdm import tqdm


def parse(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition("=")
    kw = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        try:
            kw[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            kw[k] = v
    return name, kw


def make_engine(kw: dict, dtype: str, batch: int, threads: int):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager

    spec = SpeculativeConfig()
    if kw:
        kw = dict(kw)
        algo = kw.pop("algorithm")
        spec = plugin_manager().algorithms[algo].config_class(algorithm=algo, **kw)
        spec.validate()
    return Engine(SpecfwConfig(model=ModelConfig(dtype=dtype), speculative=spec, engine=EngineConfig(num_threads=threads, max_running_requests=batch)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", help="name=key=value,... (the first is the reference; name= alone: plain decoding)")
    ap.add_argument("--dataset", choices=["mtbench", "humaneval"], default="mtbench")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specfw.datasets import humaneval_prompts, mtbench_first_turns
    from specfw.machine import cpu_description
    from specfw.sampling import SamplingParams

    configs = dict(parse(c) for c in args.configs)
    engines = {name: make_engine(kw, args.dtype, args.batch, args.threads) for name, kw in configs.items()}
    texts = (mtbench_first_turns if args.dataset == "mtbench" else humaneval_prompts)(args.start + args.n)[args.start :]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    first = next(iter(engines))
    with tqdm(total=args.rounds * len(engines), desc="runs") as bar:
        for _ in range(args.rounds):
            reference = None
            for name, eng in engines.items():
                eng.flush_cache()  # the n-gram trie must not remember the last round's outputs of these prompts
                ids = [eng.tokenize_chat([{"role": "user", "content": t}]) if args.dataset == "mtbench" else eng.tokenizer.encode(t) for t in texts]
                t0 = time.perf_counter()
                outs = eng.generate(ids, params)
                rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
                tokens = [o.token_ids for o in outs]
                reference = tokens if reference is None else reference
                if tokens != reference:
                    raise SystemExit(f"{name}: greedy output differs from {first}'s")
                bar.update()
    where = f"{args.dataset} {args.start + 1}-{args.start + args.n} x {args.max_new_tokens} tokens, {args.batch} in flight, {args.dtype}"
    print(f"\n{where}, on {cpu_description()}")
    base = statistics.median(rates[first])
    for name, r in rates.items():
        rounds = ", ".join(f"{x / y:.3f}" for x, y in zip(r, rates[first]))
        print(f"{name:24s} {statistics.median(r):7.1f} tok/s  {statistics.median(r) / base:.3f}x {first}  (rounds: {rounds})  == {first}: yes")


if __name__ == "__main__":
    main()
