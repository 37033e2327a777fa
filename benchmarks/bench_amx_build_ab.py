"""Two builds of the AMX bf16 linear (``core/kernels/bf16_amx.cpp``) alternated in one process:
the working tree's against a git revision's (default ``HEAD``), first their bits (equal, or it
stops), then the demo's 120 bf16 layer linears + lm_head alone, then whole bf16 target forwards
(greedy-only, a chain of T tree rows after a prefix) -- both builds driving ONE engine, swapped
between forwards (the one-call layers' linear address and every ``DotBF16Linear``'s module).

Why one engine: two engines built in one process ran 1.20-1.26x apart whichever was built second
(AMX Xeon, session 64), a placement effect larger than most kernel changes; rounds alternate
which build goes first. Needs a CPU with AMX-BF16.

    .venv/bin/python benchmarks/bench_amx_build_ab.py --base HEAD~1 --prefix 400
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "core/kernels/bf16_amx.cpp"
FLAGS = ["-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


def build_at(rev: str, where: Path):
    """``bf16_amx.cpp`` (and the headers beside it) as of ``rev``, built under its own name."""
    from specfw import kernels

    where.mkdir(parents=True, exist_ok=True)
    for name in ("bf16_amx.cpp", "amx_tiles.h"):
        text = subprocess.run(["git", "show", f"{rev}:core/kernels/{name}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        (where / name).write_text(text)
    return kernels._load(where / "bf16_amx.cpp", "specfw_bf16_amx_base", FLAGS, f"bf16 AMX kernel at {rev}")


def check_bits(a, b) -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in [(960, 576), (576, 1536), (100, 70), (49152, 576)]:
        packed = a.pack(torch.randn(n, k, generator=g).bfloat16())
        bias = torch.randn(n, generator=g) if n == 100 else torch.empty(0)
        for rows in (1, 5, 16, 17, 24, 33, 70):
            x = torch.randn(rows, k, generator=g).bfloat16()
            ya, yb = a.linear(x, packed, n, bias), b.linear(x, packed, n, bias)
            if not torch.equal(ya.view(torch.int16), yb.view(torch.int16)):
                sys.exit(f"the builds' bits differ at {n}x{k}, {rows} rows")


def linears_ab(builds: dict, sizes: list[int], rounds: int) -> dict[int, list[float]]:
    """Per row count, the per-round time ratios new / base of the demo's layer shapes (30 layers) + lm_head."""
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    base = builds["base"]
    weights = [[base.pack(torch.randn(n, k).bfloat16()) for _ in range(30)] for n, k in shapes]
    head = base.pack(torch.randn(49152, 576).bfloat16())
    empty = torch.empty(0)

    def run(mod, xs, hx) -> float:
        t = time.perf_counter()
        for layer in range(30):
            for (n, _), w, x in zip(shapes, weights, xs):
                mod.linear(x, w[layer], n, empty)
        mod.linear(hx, head, 49152, empty)
        return time.perf_counter() - t

    out = {}
    for M in tqdm(sizes, desc="linears"):
        xs = [torch.randn(M, k).bfloat16() for _, k in shapes]
        hx = torch.randn(M, 576).bfloat16()
        ratios = []
        for r in range(rounds):
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            t = {name: run(builds[name], xs, hx) for name in order}
            ratios.append(t["new"] / t["base"])
        out[M] = ratios
    return out


def forwards_ab(builds: dict, sizes: list[int], rounds: int, prefix: int) -> dict[int, list[float]]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_verify_cost import alternate_forwards

    from specfw import kernels
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.cpu_linear import DotBF16Linear
    from specfw.engine import Engine

    kernels._cache["bf16_amx"] = builds["new"]
    eng = Engine(
        SpecfwConfig(model=ModelConfig(dtype="bfloat16"), speculative=SpeculativeConfig(), engine=EngineConfig(num_threads=2, max_total_tokens=prefix + 64))
    )
    runner = eng.runner
    stack = runner.backend.decoder_stack(runner.model)
    if stack is None or not stack.packed_linear:
        sys.exit("the bf16 engine does not run its layers in one call on bf16_amx here")
    dots = [m for m in runner.model.modules() if isinstance(m, DotBF16Linear)]

    def use(name: str) -> None:
        mod = builds[name]
        kernels._cache["bf16_amx"] = mod  # the one-call layers' eligibility check asks for it
        stack.packed_linear = mod.linear_address()
        for m in dots:
            m.kernel = mod

    return alternate_forwards(runner, use, sizes, rounds, prefix)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base build")
    ap.add_argument("--prefix", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--sizes", default="1,2,4,8,16,17,24,32")
    args = ap.parse_args()
    from specfw import kernels
    from specfw.machine import cpu_description

    if not kernels.cpu_has_amx_bf16():
        sys.exit("this CPU has no AMX-BF16")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": build_at(args.base, Path(tmp)), "new": kernels.bf16_amx()}
        if builds["base"] is None or builds["new"] is None:
            sys.exit("a build failed")
        check_bits(builds["base"], builds["new"])
        sizes = [int(s) for s in args.sizes.split(",")]
        lin = linears_ab(builds, sizes, args.rounds)
        fwd = forwards_ab(builds, sizes, max(2, args.rounds // 2), args.prefix)
    print(f"\n{SOURCE}: working tree against {args.base}, same bits; on {cpu_description()}")
    print(f"median per-round time ratio new / base (rounds alternate which goes first); forwards: bf16 demo, prefix {args.prefix}")
    print("rows   linears   forward")
    for M in sizes:
        print(f"{M:4d}   {statistics.median(lin[M]):6.3f}x   {statistics.median(fwd[M]):6.3f}x")


if __name__ == "__main__":
    main()
