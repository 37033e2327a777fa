"""Two builds of the one-call EAGLE-3 draft step (``cpu_ops.eagle3_draft``) on the same calls:
the working tree's ``cpu_ops.cpp`` against a git revision's (default ``HEAD``).

The calls are real ones: the demo target decodes MT-bench first turns with EAGLE-3 (auto shape,
one request in flight) and every ``eagle3_draft`` call's arguments are kept (small tensors
copied; the head's weights, tables and KV pool shared). Then both builds replay all of them,
round by round, alternating which build goes first (one process, one engine: two engines built
in one process ran 1.2x apart on the AMX Xeon, session 64). Every replayed call's candidates
must be equal between the builds, or it stops. Prints ms per call of each build and the median
per-round ratio new / base; names the CPU.

    .venv/bin/python benchmarks/bench_draft_step_ab.py --base HEAD --dtype float32
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
SMALL = 1 << 16  # tensors up to this many elements are copied at capture (slot lists, rows); larger ones are shared


def build_at(rev: str, where: Path, isa: str):
    """``cpu_ops.cpp`` (and the headers beside it) as of ``rev``, built as ``cpu_ops(isa)`` builds it."""
    from specfw import kernels

    where.mkdir(parents=True, exist_ok=True)
    for name in ("cpu_ops.cpp", "amx_tiles.h", "bf16_dot_tiles.h"):
        text = subprocess.run(["git", "show", f"{rev}:core/kernels/{name}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        (where / name).write_text(text)
    new = kernels.cpu_ops(isa)
    dot = ["-mavx512bf16"] if isa == "avx512" and "avx512_bf16" in kernels._cpu_flags() else []
    amx = ["-mamx-tile", "-mamx-bf16", "-DSPECFW_AMX_ATTENTION"] if dot and kernels.cpu_has_amx_bf16() else []
    base = kernels._load(where / "cpu_ops.cpp", f"specfw_cpu_ops_{isa}_base", [*kernels._ISA_FLAGS[isa], *dot, *amx], f"cpu kernels at {rev}")
    if base is not None:  # the same process-wide settings as the engine's build
        base.set_spread_prefetch(kernels.default_spread_prefetch())
        base.set_linear_prefetch_rows(kernels.default_prefetch_rows(isa))
        base.set_amx_attention(True)
    return base, new


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.clone() if x.numel() <= SMALL else x
    if isinstance(x, list):
        return [_copy(y) for y in x]
    return x


def capture(dtype: str, prompts: int, new_tokens: int, quantization: str = "none", activations: str = "none"):
    """(engine, the ``eagle3_draft`` calls' arguments) from decoding MT-bench first turns with EAGLE-3."""
    from specfw import datasets
    from specfw.backends.kernel_draft_step import KernelDraftStep
    from specfw.bench.drive import run_engine
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.sampling import SamplingParams

    calls = []

    class Recorder:
        def __init__(self, ops):
            self.ops = ops

        def eagle3_draft(self, *args):
            calls.append(tuple(_copy(a) for a in args))
            return self.ops.eagle3_draft(*args)

        def __getattr__(self, name):
            return getattr(self.ops, name)

    call = KernelDraftStep.__call__

    def recording(self, *a, **k):
        if not isinstance(self.ops, Recorder):
            self.ops = Recorder(self.ops)
        return call(self, *a, **k)

    KernelDraftStep.__call__ = recording
    spec = plugin_manager().algorithms["eagle3"].config_class(algorithm="eagle3")
    model = ModelConfig(dtype=dtype, quantization=quantization, activation_quantization=activations)
    engine = Engine(SpecfwConfig(model=model, engine=EngineConfig(max_running_requests=1), speculative=spec))
    chat = [engine.tokenize_chat([{"role": "user", "content": q}]) for q in datasets.mtbench_first_turns(prompts)]
    run_engine(engine, chat, SamplingParams(max_new_tokens=new_tokens, temperature=0), 1, "capture")
    KernelDraftStep.__call__ = call
    if not calls:
        sys.exit("no one-call draft step ran (not a CPU kernel build, or the head is not eligible)")
    return engine, calls


def forwards_ab(engine, builds: dict, sizes: list[int], rounds: int, prefix: int) -> dict[int, list[float]]:
    """Per row count, the per-round time ratios new / base of target forwards, both builds driving
    the engine's one-call layers in turn (``bench_verify_cost.alternate_forwards``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_verify_cost import alternate_forwards

    runner = engine.runner
    stack = runner.backend.decoder_stack(runner.model)
    if stack is None:
        sys.exit("the engine does not run its layers in one call here")

    def use(name: str) -> None:
        stack.ops = builds[name]

    try:
        return alternate_forwards(runner, use, sizes, rounds, prefix)
    finally:
        use("new")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base build")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none", help="the target's model.quantization (e.g. gguf)")
    ap.add_argument("--activations", default="none", help="the target's model.activation_quantization (int8: its layers on q8_ops)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--forwards", default="", help="also target forwards of these row counts (e.g. 1,8,16), both builds in turn")
    ap.add_argument("--prefix", type=int, default=400, help="the forwards' prefix")
    args = ap.parse_args()
    from specfw import kernels
    from specfw.machine import cpu_description

    torch.set_num_threads(2)
    isa = kernels.cpu_isa()
    with tempfile.TemporaryDirectory() as tmp:
        base, new = build_at(args.base, Path(tmp), isa)
        if base is None or new is None:
            sys.exit("a build failed")
        engine, calls = capture(args.dtype, args.prompts, args.new_tokens, args.quantization, args.activations)
        builds = {"base": base, "new": new}
        times = {"base": [], "new": []}
        with torch.inference_mode():  # as the drafter calls it
            for c in calls:  # same candidates from both builds
                a, b = base.eagle3_draft(*c), new.eagle3_draft(*c)
                if not all(torch.equal(x, y) for x, y in zip(a, b)):
                    sys.exit("the builds' candidates differ")
            for r in tqdm(range(args.rounds), desc="rounds"):
                for name in ["base", "new"] if r % 2 == 0 else ["new", "base"]:
                    fn = builds[name].eagle3_draft
                    t0 = time.perf_counter()
                    for c in calls:
                        fn(*c)
                    times[name].append((time.perf_counter() - t0) / len(calls))
        sizes = [int(x) for x in args.forwards.split(",") if x]
        fwd = forwards_ab(engine, builds, sizes, max(2, args.rounds // 2), args.prefix) if sizes else {}
        engine.close()
    ratios = [n / b for n, b in zip(times["new"], times["base"])]
    target = f"{args.dtype} demo (quantization {args.quantization}, activations {args.activations}), {isa} build"
    print(f"\neagle3_draft: working tree against {args.base}, same candidates on {len(calls)} calls; {cpu_description()}; {target}")
    print(f"base {1e3 * statistics.median(times['base']):.3f} ms a call, new {1e3 * statistics.median(times['new']):.3f} ms (medians of {args.rounds} rounds)")
    print(f"median per-round ratio new / base: {statistics.median(ratios):.3f}x (range {min(ratios):.3f}-{max(ratios):.3f})")
    for T, rs in fwd.items():
        print(
            f"target forward, {T} rows after {args.prefix}: median per-round ratio new / base {statistics.median(rs):.3f}x (range {min(rs):.3f}-{max(rs):.3f})"
        )


if __name__ == "__main__":
    main()
