"""The GPU serving path side by side, in one run (issue 23): plain decoding vs eagle3 (the auto
shape and SGLang's large tree) vs ngram, at 1 and 16 requests in flight, for each attention
backend, the Triton one also with CUDA graphs. Same prompts (MT-bench first turns), greedy;
every speculative run's outputs are compared with plain decoding on the same backend.

    python benchmarks/bench_gpu.py [--dtype bfloat16] [--prompts 16] [--new-tokens 64] [--out DIR]
    python benchmarks/bench_gpu.py --device cpu --model tiny --backends torch --prompts 2   # a smoke run without a GPU

Prints one table (tok/s, speedup over plain on the same backend, accept length, == plain) and
writes it with the raw records to ``--out`` (results.md, results.jsonl). The header names the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path

import torch

ALGOS = {
    "plain": None,
    "eagle3-auto": dict(algorithm="eagle3"),
    "eagle3-5-8-32": dict(algorithm="eagle3", num_steps=5, topk=8, num_draft_tokens=32),  # SGLang's large tree
    "eagle3-3-1-4": dict(algorithm="eagle3", num_steps=3, topk=1, num_draft_tokens=4),  # a chain: the draft loop in one graph
    "eagle3-5-1-6": dict(algorithm="eagle3", num_steps=5, topk=1, num_draft_tokens=6),
    "eagle3-auto-adaptive": dict(algorithm="eagle3", adaptive_draft=True),  # the draft budget on (off on GPUs by default)
    # adaptive_draft=false: every step drafts the whole chain (the default on CUDA since session 33)
    "eagle3-3-1-4-fixed": dict(algorithm="eagle3", num_steps=3, topk=1, num_draft_tokens=4, adaptive_draft=False),
    "eagle3-5-1-6-fixed": dict(algorithm="eagle3", num_steps=5, topk=1, num_draft_tokens=6, adaptive_draft=False),
    "ngram": dict(algorithm="ngram"),
}


def settings(backends: list[str], device: str, eager: bool = True) -> list[tuple[str, str, bool]]:
    """(label, attention backend, graphs): triton with CUDA graphs first (the issue's target row),
    then each backend eager (unless not ``eager``)."""
    out = [(b, b, False) for b in backends] if eager else []
    if "triton" in backends and device.startswith("cuda"):
        out.insert(0, ("triton + CUDA graphs", "triton", True))
    return out


def build(model: str, dtype: str, device: str, attention: str, graphs: bool, algo: dict | None, max_bs: int, load_format="auto", prefix_cache=True):
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager

    spec = SpeculativeConfig()
    if algo:
        spec = plugin_manager().algorithms[algo["algorithm"]].config_class(**algo)
    engine = EngineConfig(max_running_requests=max_bs, cuda_graph_max_bs=max_bs if graphs else 0, max_total_tokens=32768, disable_radix_cache=not prefix_cache)
    return Engine(
        SpecfwConfig(
            model=ModelConfig(path=None if model == "demo" else model, dtype=dtype, device=device, attention_backend=attention, load_format=load_format),
            engine=engine,
            speculative=spec,
        )
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="demo", help="demo, tiny (a random 2-layer model: smoke runs), or a model directory")
    ap.add_argument("--backends", default="torch,triton,flashinfer")
    ap.add_argument(
        "--algos",
        default="plain,eagle3-auto,eagle3-5-8-32,eagle3-3-1-4,ngram",
        help=f"of {', '.join(ALGOS)}; one may repeat (runs of one configuration side by side)",
    )
    ap.add_argument("--no-eager", action="store_true", help="the CUDA-graph rows only")
    ap.add_argument("--no-prefix-cache", action="store_true", help="engine.disable_radix_cache=true (the chat prompts share their template's first tokens)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument(
        "--warmup-prompts", type=int, default=4, help="prompts run first at the timed length (at least the largest batch): graphs captured, kernels compiled"
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench_results/gpu")
    ap.add_argument("--deadline-s", type=float, default=0, help="start no configuration after this many seconds (0: none); the table says what was left out")
    ap.add_argument(
        "--load-format",
        default="auto",
        help="model.load_format: dummy = random target weights of the model's config (timings only: accept lengths then mean nothing)",
    )
    a = ap.parse_args()

    from specfw import datasets
    from specfw.bench.drive import run_engine
    from specfw.sampling import SamplingParams

    model = a.model
    if model == "tiny":
        from specfw.testing import tiny_model

        model = str(tiny_model())
    bss = [int(b) for b in a.batch_sizes.split(",")]
    algos = [(k, ALGOS[k]) for k in a.algos.split(",")]
    warm_n = max(max(bss), a.warmup_prompts)
    questions = datasets.mtbench_first_turns(a.prompts + warm_n)  # the last warm_n warm the engines up
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0, ignore_eos=True)
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"no GPU ({a.device})"
    weights = "" if a.load_format == "auto" else f", {a.load_format} weights"
    cache = "prefix cache off" if a.no_prefix_cache else "prefix cache on"
    header = f"{gpu}; torch {torch.__version__}; model {a.model} ({a.dtype}{weights}); MT-bench 1-{a.prompts} x {a.new_tokens} tokens, greedy, {cache}"
    print(header, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, records = [], []
    t_start = time.perf_counter()
    for label, attention, graphs in settings(a.backends.split(","), a.device, not a.no_eager):
        plain = {}
        for name, algo in algos:
            if a.deadline_s and time.perf_counter() - t_start > a.deadline_s:
                print(f"{label} {name}: not run (past --deadline-s {a.deadline_s:.0f})", flush=True)
                rows.append((label, name, "-", "-", "-", "-", "-", "not run: past the deadline"))
                continue
            for bs in bss:  # a fresh engine per concurrency: no n-gram cache or draft-budget statistics carried over
                try:
                    eng = build(model, a.dtype, a.device, attention, graphs, algo, bs, a.load_format, not a.no_prefix_cache)
                except Exception as e:  # a backend this machine lacks: say so, go on
                    print(f"{label} {name}: not run ({type(e).__name__}: {e})", flush=True)
                    rows.append((label, name, bs, "-", "-", "-", "-", f"not run: {e}"))
                    continue
                chat = [eng.tokenize_chat([{"role": "user", "content": q}]) for q in questions]
                prompts, warm = chat[: a.prompts], chat[a.prompts :]
                try:
                    # kernels compiled, this concurrency's graphs captured, on other prompts than the timed ones
                    run_engine(eng, warm[: max(bs, a.warmup_prompts)], params, bs, "warm-up")
                    before = captured_graphs(eng)
                    res = run_engine(eng, prompts, params, bs, f"{label} {name} bs={bs}")
                    late = captured_graphs(eng) - before
                except Exception as e:  # a failing setting must not cost the rest of the table
                    traceback.print_exc()
                    rows.append((label, name, bs, "-", "-", "-", "-", f"failed: {type(e).__name__}: {e}"))
                    _write(out, header, rows, records)
                    _close(eng)
                    continue
                if algo is None:
                    plain[bs] = res
                base = plain.get(bs)
                same = "" if algo is None or base is None else f"{sum(x == y for x, y in zip(res.outputs, base.outputs))}/{len(prompts)}"
                speed = "" if base is None else f"{res.tok_s / base.tok_s:.2f}x"
                acc = f"{res.accept_length:.2f}" if res.accept_length else ""
                graphed = getattr(eng.runner.graphs, "replays", 0) if eng.runner.graphs else 0
                policy = getattr(eng.worker, "policy", None)
                notes = [f"{graphed} graphed forwards, {late} graphs captured while timed"] if graphs else []
                notes += [f"adaptive draft {'on' if policy.adaptive else 'off'}"] if policy is not None else []  # auto: a startup timing decides
                note = "; ".join(notes)
                rows.append((label, name, bs, f"{res.tok_s:.1f}", speed, acc, same, note))
                records.append(
                    dict(
                        setting=label,
                        attention=attention,
                        graphs=graphs,
                        algo=name,
                        batch_size=bs,
                        tok_s=res.tok_s,
                        accept_length=res.accept_length,
                        same=same,
                        graphs_captured_while_timed=late,
                    )
                )
                print(" | ".join(str(x) for x in rows[-1]), flush=True)
                _write(out, header, rows, records)
                _close(eng)
    print(_write(out, header, rows, records))


def captured_graphs(eng) -> int:
    """CUDA graphs the engine holds: the target's forwards, the draft head's, the chain draft's.
    One captured while timed is a capture (and its kernels' compiles) counted as serving time."""
    runtime = getattr(eng.worker, "runtime", None)
    holders = (eng.runner.graphs, getattr(runtime, "graphs", None), getattr(runtime, "chain", None))
    return sum(len(getattr(h, "entries", None) or {}) for h in holders)


def _close(eng) -> None:
    eng.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write(out: Path, header: str, rows: list, records: list) -> str:
    """results.md / results.jsonl as they stand (rewritten after every row: a run cut short keeps its rows)."""
    table = [
        f"{header} ({time.strftime('%Y-%m-%d')})",
        "",
        "| setting | algorithm | in flight | tok/s | vs plain | accept len | == plain | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    table += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    (out / "results.md").write_text("\n".join(table) + "\n")
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return "\n".join(table)


if __name__ == "__main__":
    main()
