"""Plain (non-speculative) worker: one target forward per step, one token per request."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model_runner import ModelRunner, build_forward_batch
from .request import Request
from .sampling import TokenLogprob, sample_one


@dataclass
class SeqResult:
    """What one step produced for one request."""
    tokens: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_draft: int = 0         # draft tokens proposed (speculative only)
    num_accepted: int = 0      # draft tokens accepted


EMPTY = torch.empty(0, dtype=torch.long)


def sample_rows(logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
    """Sample one token per row of logits [B, V]."""
    if all(r.params.greedy and not r.params.has_penalties and not r.params.logprobs for r in reqs):
        return [(t, None) for t in logits.argmax(-1).tolist()]
    return [sample_one(logits[i], r.params, r.generator, r.prompt_ids, r.output_ids) for i, r in enumerate(reqs)]


def prefill_chunks(runner: ModelRunner, reqs: list[Request]):
    """Allocate slots for every uncached token of each request; returns forward chunks."""
    chunks = []
    for r in reqs:
        ids = r.seq_ids[r.num_cached:]
        start = r.num_cached
        slots = runner.allocator.alloc(len(ids))
        chunks.append((torch.tensor(ids, dtype=torch.long), torch.arange(start, start + len(ids)),
                       slots, r.slots.slots(), None))
        r.slots.append(slots)
    return chunks


class PlainWorker:
    slots_per_decode = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def prefill(self, reqs: list[Request]) -> list[SeqResult]:
        fb = build_forward_batch(prefill_chunks(self.runner, reqs), last_only=True)
        out = self.runner.forward(fb)
        return [SeqResult([t], [lp] if lp else []) for t, lp in sample_rows(out.logits, reqs)]

    def decode(self, reqs: list[Request]) -> list[SeqResult]:
        slots = self.runner.allocator.alloc(len(reqs))
        chunks = []
        for i, r in enumerate(reqs):
            s = slots[i:i + 1]
            chunks.append((torch.tensor(r.seq_ids[-1:], dtype=torch.long), torch.tensor([r.num_cached]), s, r.slots.slots(), None))
        fb = build_forward_batch(chunks)
        out = self.runner.forward(fb)
        for i, r in enumerate(reqs):
            r.slots.append(slots[i:i + 1])
        return [SeqResult([t], [lp] if lp else []) for t, lp in sample_rows(out.logits, reqs)]

    def release(self, req: Request) -> None:
        """Drop any per-request worker state (none for plain decoding)."""
