"""Speculative decoding benchmark on the demo model: plain decode vs algorithms, one run.

    .venv/bin/python benchmarks/bench_spec.py --dataset humaneval --n 20 \
        --algo ngram --algo "ngram:num_draft_tokens=6,max_bfs_breadth=2" --hf-prompt-lookup
    .venv/bin/python benchmarks/bench_spec.py --dataset mtbench --n 80 --algo eagle3 --algo eagle \
        --algo "standalone:draft_model_path=PATH" --algo ngram

Prints tokens/s, speedup over plain decode, accept length (tokens per verify forward, bonus
included), accept rate and per-position acceptance; writes JSON and a bar plot to --out.
Batch 1 (one request at a time; ``--concurrency N``: all prompts submitted at once, N decoded
together), greedy, same prompts and thread count for every row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm


def parse_algo(spec: str):
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
    from specfw.datasets import humaneval_prompts, mtbench_first_turns

    if dataset == "humaneval":
        return [engine.tokenizer(p)["input_ids"] for p in humaneval_prompts(n)]
    return [engine.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(n)]


def run_engine(engine, prompts, params, label, concurrency: int = 1):
    if concurrency > 1:
        t0 = time.perf_counter()
        outs = [o.token_ids for o in engine.generate(prompts, params, progress=True)]
        return sum(len(o) for o in outs) / (time.perf_counter() - t0), outs
    n, t = 0, 0.0
    outs = []
    for p in tqdm(prompts, desc=label):
        t0 = time.perf_counter()
        o = engine.generate([p], params)[0]
        t += time.perf_counter() - t0
        n += len(o.token_ids)
        outs.append(o.token_ids)
    return n / t, outs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=["humaneval", "mtbench"], default="humaneval")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto", help="model.device: auto | cpu | cuda | cuda:N")
    ap.add_argument("--algo", action="append", default=[], help="name[:key=value,...] (repeatable)")
    ap.add_argument("--hf-prompt-lookup", action="store_true", help="also time HF prompt lookup decoding")
    ap.add_argument("--no-batch-invariant", action="store_true", help="every row with engine.batch_invariant=false")
    ap.add_argument(
        "--engine", action="append", default=[], metavar="KEY=VALUE", help="an engine.* setting for every row, e.g. cpu_bf16_kernel=false (repeatable)"
    )
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoded together (all prompts submitted at once)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from omegaconf import OmegaConf
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.sampling import SamplingParams

    def engine_for(spec):
        return Engine(
            SpecfwConfig(
                model=ModelConfig(dtype=args.dtype, device=args.device),
                speculative=spec,
                engine=EngineConfig(
                    max_running_requests=args.concurrency,
                    num_threads=args.threads,
                    batch_invariant=not args.no_batch_invariant,
                    **parse_algo(":" + ",".join(args.engine))[1],
                ),
            )
        )

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    plain = engine_for(SpeculativeConfig())
    prompts = load_prompts(args.dataset, args.n, plain)
    plain_device, kernels = plain.device, plain.backend.describe()
    plain.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0))
    rows = []
    base_tps, ref = run_engine(plain, prompts, params, "plain", args.concurrency)
    rows.append(dict(algo="plain", tok_s=base_tps, speedup=1.0, accept_len=1.0, exact=True))

    if args.hf_prompt_lookup:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(plain.model_path, dtype=getattr(torch, args.dtype)).eval()
        for label, kw in [("hf_greedy", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10})]:
            n, t, exact = 0, 0.0, 0
            for p, r in zip(tqdm(prompts, desc=label), ref):
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = hf.generate(
                        torch.tensor([p]),
                        max_new_tokens=args.max_new_tokens,
                        do_sample=False,
                        eos_token_id=plain.tokenizer.eos_token_id,
                        pad_token_id=plain.tokenizer.eos_token_id,
                        **kw,
                    )
                t += time.perf_counter() - t0
                toks = out[0, len(p) :].tolist()
                n += len(toks)
                exact += toks == r
            rows.append(dict(algo=label, tok_s=n / t, speedup=n / t / base_tps, accept_len=None, exact=exact == len(prompts)))
    del plain

    for spec_str in args.algo:
        name, kw = parse_algo(spec_str)
        algo = plugin_manager().algorithms[name]
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(algo.config_class(algorithm=name)), kw))
        eng = engine_for(cfg)
        eng.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0))
        eng.stats.__init__()
        tps, outs = run_engine(eng, prompts, params, spec_str, args.concurrency)
        st = eng.stats
        pos = [a / p if p else 0.0 for a, p in zip(st.position_accepts, st.position_proposals)]
        rows.append(
            dict(
                algo=spec_str,
                tok_s=tps,
                speedup=tps / base_tps,
                accept_len=st.accept_length,
                accept_rate=st.accept_rate,
                per_position=pos,
                tree_sizes=eng.worker.budget.summary(),
                tree_rates={k: round(v, 1) for k, v in eng.worker.budget.rates(1).items()},
                pruning=pruning_summary(eng.worker.pruning),
                exact=sum(o == r for o, r in zip(outs, ref)) == len(ref),
            )
        )
        del eng

    from specfw.machine import cpu_description

    print(
        f"\n{args.dataset}: {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
        f"{'batch 1' if args.concurrency == 1 else f'{args.concurrency} concurrent'}, greedy, "
        f"{args.dtype}, device {plain_device}, {args.threads} threads, batch_invariant={not args.no_batch_invariant}"
    )
    print(f"on {cpu_description()}; kernels: {kernels}")
    print(f"{'algorithm':<44} {'tok/s':>8} {'speedup':>8} {'accept len':>11} {'== plain':>9}")
    for r in rows:
        al = f"{r['accept_len']:.2f}" if r.get("accept_len") else "-"
        print(f"{r['algo']:<44} {r['tok_s']:8.2f} {r['speedup']:7.2f}x {al:>11} {str(r['exact']):>9}")
    for r in rows:
        if r.get("per_position"):
            print(f"per-position acceptance {r['algo']}: " + " ".join(f"{p:.2f}" for p in r["per_position"]))
        if r.get("pruning") and r["pruning"]["kept_nodes"] + r["pruning"]["pruned_nodes"]:
            pr = r["pruning"]
            print(
                f"confidence pruning {r['algo']}: kept {pr['kept_nodes']} of {pr['kept_nodes'] + pr['pruned_nodes']} "
                f"draft nodes, threshold {pr['threshold']:.3f}; learned acceptance by draft probability: "
                + " ".join(f"{lo:g}+:{p:.2f}" for lo, p in pr["calibration"])
            )
        if r.get("tree_sizes"):
            print(f"verified tree sizes (size: steps) {r['algo']}: {r['tree_sizes']}; estimated tok/s per size: {r['tree_rates']}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"spec_{args.dataset}_{time.strftime('%Y%m%d-%H%M%S')}"
    (args.out / f"{stem}.json").write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)}, rows=rows), indent=2))
    plot(rows, args.out / f"{stem}.png", f"{args.dataset}, batch 1, {args.dtype}")
    if plot_calibration(rows, args.out / f"{stem}_calibration.png"):
        print(f"wrote {args.out / stem}_calibration.png")
    print(f"wrote {args.out / stem}.json and .png")


def pruning_summary(pruning) -> dict:
    """Confidence pruning's state after a run: nodes kept/pruned, the batch-1 threshold at the
    end, the learned acceptance probability per draft-probability bin."""
    from specfw.speculative.confidence import PROB_EDGES

    cal = pruning.calibration
    return dict(
        kept_nodes=pruning.kept_nodes,
        pruned_nodes=pruning.pruned_nodes,
        threshold=pruning.last_threshold.get(1, 0.0),
        calibration=[(lo, round(cal.prob_in_bin(b), 3)) for b, lo in enumerate(PROB_EDGES)],
    )


def plot_calibration(rows, path) -> bool:
    """Learned acceptance probability against the draft's own probability, per pruned row."""
    rows = [r for r in rows if r.get("pruning") and r["pruning"]["kept_nodes"]]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from specfw.speculative.confidence import PROB_EDGES

    mids = [(lo + hi) / 2 for lo, hi in zip(PROB_EDGES, PROB_EDGES[1:] + (1.0,))]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--", label="calibrated draft")
    for r in rows:
        ax.plot(mids, [p for _, p in r["pruning"]["calibration"]], marker="o", ms=3, label=r["algo"])
        ax.axhline(r["pruning"]["threshold"], lw=0.6, ls=":", color=ax.lines[-1].get_color())
    ax.set_xlabel("draft probability of the node (exp score)")
    ax.set_ylabel("learned P(target accepts it)")
    ax.set_title("confidence pruning: calibration (dotted: threshold)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    names = [r["algo"] for r in rows]
    ax.barh(names, [r["speedup"] for r in rows], color=["gray" if r["algo"] == "plain" else "tab:blue" for r in rows])
    for i, r in enumerate(rows):
        label = f"{r['tok_s']:.1f} tok/s" + (f", accept {r['accept_len']:.2f}" if r.get("accept_len") else "")
        ax.text(r["speedup"], i, " " + label, va="center", fontsize=8)
    ax.axvline(1.0, color="k", lw=0.5)
    ax.set_xlabel("speedup over plain decode")
    ax.set_title(title)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
