"""The greedy head's proxies side by side: the cost of one call of the lm_head for greedy rows
(``GreedyHead``: a cheap copy of the head, the possible argmaxes recomputed exactly) with the bf16
copy and with the int8 one (``engine.cpu_greedy_head_proxy``), and the full head for reference, on
the demo target's real hidden rows. ``--dtype bfloat16``: a bf16 model, whose head takes the int8
copy alone (its bf16 weight is the full head).

    .venv/bin/python benchmarks/bench_greedy_head.py [--rows 1,4,8,16] [--isa auto] [--reps 30]

Rows are the final-norm outputs of MT-bench decode steps (captured while the demo target decodes
a few first turns), so the candidate counts are the ones decoding meets. Between calls a 256 MB
buffer is read, so each call finds the head's weights in DRAM, as it does after a forward's 30
layers. The proxies are timed interleaved, call by call, and every call's argmax checked against
the full head. Prints per row count the median milliseconds a call, each proxy's ratio to the bf16
copy's, and the candidates recomputed per row; names the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm


def capture_rows(eng, prompts: list[list[int]], tokens: int) -> torch.Tensor:
    """The normed hidden rows the greedy head gets while ``eng`` decodes ``prompts`` greedily."""
    from specfw.backends.greedy_head import GreedyHead
    from specfw.sampling import SamplingParams

    rows, real = [], GreedyHead.select  # what a greedy_only forward calls

    def record(self, x):
        rows.append(x.detach().float().clone())
        return real(self, x)

    GreedyHead.select = record
    try:
        eng.generate(prompts, SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True))
    finally:
        GreedyHead.select = real
    return torch.cat(rows)


def candidates(out: torch.Tensor) -> float:
    """Finite entries a row: the logits the head recomputed exactly."""
    return float(torch.isfinite(out).sum(1).float().mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,16", help="rows a call (a decode step's, a tree's)")
    ap.add_argument("--isa", default="auto", help="engine.cpu_isa: the kernels' build (avx2: its AVX2 path on an AVX-512 CPU too)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--model", default=None, help="a model directory (default: the demo target)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()

    from specfw import datasets
    from specfw.backends.greedy_head import GreedyHead
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig
    from specfw.engine import Engine
    from specfw.kernels import q8_ops
    from specfw.machine import cpu_description

    cfg = SpecfwConfig(model=ModelConfig(path=a.model, dtype=a.dtype, device="cpu"), engine=EngineConfig(max_running_requests=1, cpu_isa=a.isa))
    with Engine(cfg) as eng:
        backend, model = eng.runner.backend, eng.runner.model
        head = model.lm_head
        on_bf16 = hasattr(head, "packed") and GreedyHead.bf16_eligible(head)  # bf16 weights: the int8 copy alone
        if not (on_bf16 or GreedyHead.eligible(head)) or not hasattr(backend, "_greedy_dot"):
            raise SystemExit("this model's lm_head does not take a greedy head (fp32 or bf16 weights on specfw's CPU kernels)")
        print(f"CPU: {cpu_description()}; kernels {backend.isa}; lm_head {head.out_features} x {head.in_features} {a.dtype}", flush=True)
        chats = [eng.tokenize_chat([{"role": "user", "content": q}]) for q in datasets.mtbench_first_turns(a.prompts)]
        pool = capture_rows(eng, chats, 32).to(torch.bfloat16 if a.dtype == "bfloat16" else torch.float32)
        heads = {} if on_bf16 else {"bf16": GreedyHead(backend.ops, head, backend._greedy_dot())}
        if GreedyHead.int8_eligible(head) and q8_ops(backend.isa) is not None:
            heads["int8"] = GreedyHead(backend.ops, head, q8=q8_ops(backend.isa))
        ref = "bf16" if "bf16" in heads else "full"
        print(f"{pool.shape[0]} captured rows; proxies: " + ", ".join(f"{k} {_mib(h):.1f} MiB" for k, h in heads.items()), flush=True)
        junk = torch.randn(64 * 2**20)  # 256 MB
        g = torch.Generator().manual_seed(0)
        cols = [f"full {a.dtype} head", *(f"{k} proxy" for k in heads), *(f"{k}/{ref}" for k in heads if k != ref), "candidates a row"]
        print("| rows | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 1) + "|")
        for n in [int(r) for r in a.rows.split(",")]:
            times = {k: [] for k in ["full", *heads]}
            cands = {k: [] for k in heads}
            for _ in tqdm(range(a.reps), desc=f"{n} rows", leave=False):
                x = pool[torch.randint(pool.shape[0], (n,), generator=g)].contiguous()
                for k, fn in [("full", head), *heads.items()]:
                    junk.sum()
                    t0 = time.perf_counter()
                    out = fn(x).float()
                    times[k].append(time.perf_counter() - t0)
                    if k == "full":
                        want = out.argmax(1)
                    else:
                        assert torch.equal(out.argmax(1), want), f"{k} proxy: another argmax than the full head"
                        cands[k].append(candidates(out))
            med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            cells = [f"{med['full']:.3f} ms", *(f"{med[k]:.3f} ms" for k in heads), *(f"{med[k] / med[ref]:.2f}x" for k in heads if k != ref)]
            cells.append(", ".join(f"{k} {statistics.mean(v):.1f}" for k, v in cands.items()))
            print(f"| {n} | " + " | ".join(cells) + " |")


def _mib(h) -> float:
    parts = [h.codes, h.scales] if h.q8 is not None else [h.proxy]
    return sum(t.numel() * t.element_size() for t in parts) / 2**20


if __name__ == "__main__":
    main()
