"""Offline quality of an EAGLE-3 draft: top-1 agreement with the target per unroll step,
teacher-forced exactly as in training (``specfw_plugins.eagle3.trainer``), on held-out text.

    .venv/bin/python benchmarks/eval_draft_agreement.py                       # demo draft, MT-bench
    .venv/bin/python benchmarks/eval_draft_agreement.py --draft drafts/eagle3/draft --n 40
    .venv/bin/python benchmarks/eval_draft_agreement.py --responses ~/.cache/specfw/train/SmolLM2-135M-Instruct/responses-bfloat16.jsonl
    .venv/bin/python benchmarks/eval_draft_agreement.py --responses CACHE --response-tokens 64   # like MT-bench's 64

The sequences are the target's own greedy answers (on-policy) to MT-bench first turns, or records
of a regenerated-responses cache (``--responses``: training data, to compare). Step j's agreement
is P(draft top-1 at depth j == target top-1) given the true tokens before it, which is what the
drafter sees online wherever its earlier draft tokens were right.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm


def sequences(args, tokenizer_engine):
    from specfw.train.data import Example

    if args.responses:
        opener = gzip.open if args.responses.endswith(".gz") else open
        with opener(args.responses, "rt") as f:
            recs = [json.loads(line) for line in f if line.strip()]
        random.Random(0).shuffle(recs)
        cut = args.response_tokens or None
        return [
            Example(
                (r["prompt_ids"] + r["response_ids"][:cut])[: args.max_len], ([0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"][:cut]))[: args.max_len]
            )
            for r in recs[: args.n]
        ]
    from specfw.datasets import mtbench_first_turns
    from specfw.sampling import SamplingParams

    eng = tokenizer_engine()
    prompts = [eng.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(args.n)]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0), progress=True)
    return [Example(p + o.token_ids, [0] * len(p) + [1] * len(o.token_ids)) for p, o in zip(prompts, outs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft directory (default: the committed demo draft)")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=320, help="sequence cap for --responses records")
    ap.add_argument("--responses", default=None, help="regenerated-responses cache (.jsonl or .jsonl.gz) instead of MT-bench")
    ap.add_argument(
        "--response-tokens", type=int, default=0, help="score only the first N response tokens of --responses records (0 = all), like MT-bench's 64"
    )
    ap.add_argument("--steps", type=int, default=6, help="unroll depth")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specfw.config import SpecfwConfig
    from specfw.demo_model import demo_model_dir
    from specfw.engine import Engine
    from specfw_plugins.eagle3.trainer import Eagle3Trainer
    from specfw.train.target import TargetTeacher
    from specfw_plugins.eagle3.drafter import DEMO_DRAFT
    from specfw_plugins.eagle3.model import load_eagle3

    exs = sequences(args, lambda: Engine(SpecfwConfig()))
    teacher = TargetTeacher(demo_model_dir(), torch.float32)
    cfg = SimpleNamespace(
        draft=SimpleNamespace(aux_layers=None, draft_vocab_size=8192, ttt_steps=args.steps, ttt_decay=1.0), data=SimpleNamespace(max_len=4096)
    )
    trainer = Eagle3Trainer(cfg, teacher, exs[:1])
    draft = Path(args.draft) if args.draft else DEMO_DRAFT
    trainer.head = load_eagle3(draft, teacher.config, torch.float32)
    trainer.draft_ids = trainer.head.to_target_ids()
    trainer.aux_layers = tuple(i + 1 for i in trainer.head.config.eagle_config["eagle_aux_hidden_state_layer_ids"])
    sums, weight = {}, 0
    with torch.no_grad():
        for e in tqdm(exs, desc="scoring"):
            ids = torch.tensor([e.input_ids])
            mask = torch.tensor([e.loss_mask], dtype=torch.float32)
            _, metrics = trainer.loss(ids, mask, torch.ones_like(ids, dtype=torch.bool))
            w = float(mask.sum())
            weight += w
            for k, v in metrics.items():
                if k.startswith("acc"):
                    sums[k] = sums.get(k, 0.0) + v * w
    src = (
        f"{args.responses} (first {args.response_tokens or 'all'} response tokens)"
        if args.responses
        else f"MT-bench first turns x {args.max_new_tokens} greedy tokens"
    )
    print(f"draft {draft}; {len(exs)} sequences from {src}; {int(weight)} scored tokens")
    print("top-1 agreement per unroll step: " + " ".join(f"{sums[k] / weight:.3f}" for k in sorted(sums)))


if __name__ == "__main__":
    main()
