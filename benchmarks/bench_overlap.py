"""The overlap scheduler on and off, in one run (issue 20): real ``specfw serve`` processes (uvicorn
on 127.0.0.1, streamed chat completions through the OpenAI-style API), MT-bench first turns,
greedy, at 1 and at ``--concurrency`` requests in flight, for plain decoding and for a topk=1
EAGLE-3 chain (the overlap scheduler takes chains only). One server at a time on the machine.

    .venv/bin/python benchmarks/bench_overlap.py [--prompts 16] [--max-new-tokens 64] [--concurrency 16]
        [--threads 2] [--model-args model.quantization=gguf model.activation_quantization=int8]

Off and on are measured alternately ``--rounds`` times (a fresh server each); prints the CPU, then
per setting the median tokens/s off and on and their ratio, whether every stream's text in every
run equals the first run's with the scheduler off, and the median TTFT and inter-token latency.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_server import serve  # noqa: E402

SETTINGS = {
    "plain": [],
    "eagle3 chain (5,1,6)": ["speculative=eagle3", "speculative.num_steps=5", "speculative.topk=1"],
}


def measure(extra: list[str], threads: int, prompts, args) -> dict:
    from specfw.bench.client import run_server

    proc, port = serve(extra, threads)
    url = f"http://127.0.0.1:{port}"
    try:
        run_server(url, prompts[:1], 4, 0.0, True, 1, desc="warm-up")
        out = {}
        for conc, n in ((1, args.prompts), (args.concurrency, args.prompts * 2)):
            r = run_server(url, prompts[:n], args.max_new_tokens, 0.0, True, conc, desc=f"{' '.join(extra) or 'plain'} x{conc}")
            out[conc] = r
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="off/on measured alternately this many times; medians reported")
    ap.add_argument("--model-args", nargs="*", default=["model.quantization=gguf", "model.activation_quantization=int8"])
    args = ap.parse_args()

    from types import SimpleNamespace

    from specfw.bench.prompts import load_prompts
    from specfw.machine import cpu_description

    prompts = load_prompts(SimpleNamespace(dataset="mtbench", path=None, start=0, num_prompts=args.prompts * 2))
    common = [*args.model_args, f"engine.max_running_requests={args.concurrency}", "tuned.use=false"]
    rows = []
    for name, extra in SETTINGS.items():
        runs = {False: [], True: []}
        for _ in range(args.rounds):  # alternate, so that drifts of the machine hit both alike
            for on in (False, True):
                runs[on].append(measure(common + extra + [f"engine.overlap_schedule={str(on).lower()}"], args.threads, prompts, args))
        for conc in runs[False][0]:
            rate = {on: statistics.median(r[conc].output_tokens / r[conc].seconds for r in runs[on]) for on in runs}
            same = all(r[conc].outputs == runs[False][0][conc].outputs for on in runs for r in runs[on])
            ttft = {on: 1000 * statistics.median(statistics.median(r[conc].ttft) for r in runs[on]) for on in runs}
            itl = {on: 1000 * statistics.median(statistics.median(r[conc].itl) for r in runs[on]) for on in runs}
            rows.append((name, conc, rate[False], rate[True], same, runs[True][0][conc].accept_length, ttft, itl))
    model = " ".join(args.model_args) or "fp32"
    print(f"\nMT-bench first turns x {args.max_new_tokens} tokens, greedy, streamed through specfw serve, {args.threads} threads, {model}")
    print(f"on {cpu_description()}")
    print(f"medians of {args.rounds} alternating rounds")
    print(f"{'setting':24s} {'in flight':>9s} {'off tok/s':>10s} {'on tok/s':>10s} {'on/off':>7s}  same text  accept  TTFT p50 off/on ms  ITL p50 off/on ms")
    for name, conc, a, b, same, acc, ttft, itl in rows:
        lat = f"{ttft[False]:8.1f} / {ttft[True]:6.1f}  {itl[False]:7.1f} / {itl[True]:6.1f}"
        print(f"{name:24s} {conc:9d} {a:10.1f} {b:10.1f} {b / a:6.2f}x  {str(same):9s}  {acc or '':6.4}  {lat}")


if __name__ == "__main__":
    main()
