"""Accept length against tree size, on the same prompts, one run.

    .venv/bin/python benchmarks/bench_tree_sweep.py --dataset mtbench --n 40 --algo eagle3 --algo eagle \
        --shape 3,1,4 --shape 5,4,8 --shape 5,8,16 --shape 5,8,32 --shape 7,8,32 --shape 7,10,64

Every algorithm runs at every tree shape (``num_steps,topk,num_draft_tokens``) with
``adaptive_draft=false``: each step verifies the full tree, as SGLang does on a GPU, where a
verify forward costs about the same for 1 or 64 rows. So the accept lengths say what a draft
achieves with a given tree budget on any hardware; the tokens/s are this machine's (on a CPU a
verify grows with its rows, see ``bench_verify_cost.py``). Prints accept length, per-position
acceptance, tokens/s against plain decoding and whether the output equals plain greedy; writes
JSON and a plot (accept length and CPU speedup against ``num_draft_tokens``) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_spec import load_prompts, run_engine  # noqa: E402


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        steps, topk, tokens = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants num_steps,topk,num_draft_tokens, got '{text}'") from None
    return steps, topk, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=["humaneval", "mtbench"], default="mtbench")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto", help="model.device: auto | cpu | cuda | cuda:N")
    ap.add_argument("--algo", action="append", default=[], help="algorithm name (repeatable)")
    ap.add_argument("--shape", action="append", type=parse_shape, default=[], help="num_steps,topk,num_draft_tokens (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    algos = args.algo or ["eagle3"]
    shapes = args.shape or [(3, 1, 4), (5, 4, 8), (5, 8, 16), (5, 8, 32), (7, 8, 32)]
    torch.set_num_threads(args.threads)

    from omegaconf import OmegaConf
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.sampling import SamplingParams

    def engine_for(spec):
        return Engine(
            SpecfwConfig(
                model=ModelConfig(dtype=args.dtype, device=args.device), speculative=spec, engine=EngineConfig(max_running_requests=1, num_threads=args.threads)
            )
        )

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    plain = engine_for(SpeculativeConfig())
    prompts = load_prompts(args.dataset, args.n, plain)
    plain.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0))
    base_tps, ref = run_engine(plain, prompts, params, "plain")
    del plain

    registry = plugin_manager().algorithms
    rows = []
    for name in algos:
        for steps, topk, tokens in shapes:
            kw = dict(num_steps=steps, topk=topk, num_draft_tokens=tokens, adaptive_draft=False)
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(registry[name].config_class(algorithm=name)), kw))
            eng = engine_for(cfg)
            eng.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0))
            eng.stats.__init__()
            label = f"{name} ({steps}, {topk}, {tokens})"
            tps, outs = run_engine(eng, prompts, params, label)
            st = eng.stats
            rows.append(
                dict(
                    algo=name,
                    shape=[steps, topk, tokens],
                    tok_s=tps,
                    speedup=tps / base_tps,
                    accept_len=st.accept_length,
                    per_position=[a / p if p else 0.0 for a, p in zip(st.position_accepts, st.position_proposals)],
                    exact=all(o == r for o, r in zip(outs, ref)),
                )
            )
            del eng

    print(
        f"\n{args.dataset}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, batch 1, greedy, {args.dtype}, "
        f"{args.threads} threads, full trees every step; plain {base_tps:.2f} tok/s"
    )
    print(f"{'algorithm (steps, topk, tokens)':<34} {'accept len':>10} {'tok/s':>8} {'vs plain':>9} {'== plain':>9}  per-position")
    for r in rows:
        label = f"{r['algo']} {tuple(r['shape'])}"
        pos = " ".join(f"{p:.2f}" for p in r["per_position"])
        print(f"{label:<34} {r['accept_len']:10.2f} {r['tok_s']:8.2f} {r['speedup']:8.2f}x {str(r['exact']):>9}  {pos}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"tree_sweep_{args.dataset}_{time.strftime('%Y%m%d-%H%M%S')}"
    (args.out / f"{stem}.json").write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)}, plain_tok_s=base_tps, rows=rows), indent=2))
    plot(rows, args.out / f"{stem}.png", f"{args.dataset}, {len(prompts)} prompts, batch 1, full trees")
    print(f"wrote {args.out / stem}.json and .png")


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, spd) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in dict.fromkeys(r["algo"] for r in rows):
        mine = sorted((r for r in rows if r["algo"] == name), key=lambda r: (r["shape"][2], r["shape"][0]))
        x = [r["shape"][2] for r in mine]
        acc.plot(x, [r["accept_len"] for r in mine], marker="o", label=name)
        spd.plot(x, [r["speedup"] for r in mine], marker="o", label=name)
        for r in mine:
            acc.annotate("{},{},{}".format(*r["shape"]), (r["shape"][2], r["accept_len"]), fontsize=7, textcoords="offset points", xytext=(4, -10))
    for ax in (acc, spd):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("num_draft_tokens (tree nodes incl. root)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    acc.set_ylabel("accept length (tokens per verify)")
    acc.set_title("accept length (hardware-independent)")
    spd.axhline(1.0, color="k", lw=0.5)
    spd.set_ylabel("tok/s vs plain decoding, this CPU")
    spd.set_title("speed on this machine")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
