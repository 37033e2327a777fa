"""Thin wrapper over ``specfw bench`` (kept for the commands in docs/benchmarks.md's history):
translates this script's flags into ``specfw bench`` overrides, prints the command and runs it.

    .venv/bin/python benchmarks/bench_spec.py --dataset mtbench --n 80 --algo eagle3 --algo ngram
    # = specfw bench -m speculative=eagle3,ngram bench.prompts.dataset=mtbench bench.prompts.num_prompts=80 ...
    .venv/bin/python benchmarks/bench_spec.py --algo "eagle3:num_steps=3,topk=1,num_draft_tokens=4" --algo ngram
    # an algorithm with settings runs as its own `specfw bench` into the same run directory

``parse_algo`` and ``load_prompts`` stay importable (benchmarks/bench_quant.py uses them).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path


def parse_algo(spec: str):
    """``name[:key=value,...]`` -> (name, {key: value}) with ints, floats and booleans parsed."""
    name, _, rest = spec.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        if v.lower() in ("true", "false"):
            kw[k] = v.lower() == "true"
            continue
        try:
            kw[k] = int(v)
        except ValueError:
            try:
                kw[k] = float(v)
            except ValueError:
                kw[k] = v
    return name, kw


def load_prompts(dataset: str, n: int, engine):
    """The first ``n`` prompts of ``dataset`` as ``engine``'s token ids (``specfw bench``'s sets)."""
    from specfw.bench.config import PromptSet
    from specfw.bench.prompts import load_prompts as load, token_ids

    return token_ids(engine, load(PromptSet(dataset=dataset, num_prompts=n)))


def commands(args) -> list[list[str]]:
    common = [
        f"bench.prompts.dataset={args.dataset}",
        f"bench.prompts.num_prompts={args.n}",
        f"bench.max_new_tokens={args.max_new_tokens}",
        f"bench.batch_sizes=[{args.concurrency}]",
        f"engine.num_threads={args.threads}",
        f"model.dtype={args.dtype}",
        f"model.device={args.device}",
        f"bench.out_dir={args.out}",
        f"bench.name=spec_{args.dataset}_{time.strftime('%Y%m%d-%H%M%S')}",
    ]
    common += ["engine.batch_invariant=false"] if args.no_batch_invariant else []
    common += [f"engine.{kv}" for kv in args.engine]
    algos = [parse_algo(a) for a in args.algo] or [("none", {})]
    plain = [name for name, kw in algos if not kw]
    runs = [["-m", f"speculative={','.join(plain)}"]] if plain else []
    runs += [[f"speculative={name}"] + [f"speculative.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items()] for name, kw in algos if kw]
    specfw = str(Path(sys.executable).parent / "specfw")
    return [[specfw, "bench", *run, *common] for run in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=["humaneval", "mtbench", "sharegpt"], default="humaneval")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto", help="model.device: auto | cpu | cuda | cuda:N")
    ap.add_argument("--algo", action="append", default=[], help="name[:key=value,...] (repeatable)")
    ap.add_argument("--no-batch-invariant", action="store_true", help="every row with engine.batch_invariant=false")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="an engine.* setting for every row (repeatable)")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    for cmd in commands(args):
        print("$ " + shlex.join(cmd), flush=True)
        if subprocess.call(cmd) != 0:
            sys.exit(1)


if __name__ == "__main__":
    main()
