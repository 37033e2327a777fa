"""Plain (non-speculative) worker: one target forward per step, one token per request.

A worker computes a scheduled batch and returns one ``StepResult`` per request; it writes KV
only into the slots the scheduler reserved for the step (``batch.new_slots``) and leaves the
KV tables and request states to the scheduler (``Scheduler.update``)."""

from __future__ import annotations

import torch

from .forward_batch import ForwardOutput
from .model_runner import ModelRunner, build_forward_batch
from .request import Request
from .sampling import TokenLogprob, sample_one
from .scheduler import ScheduledBatch
from .step import StepResult


def argmax_only(reqs: list[Request]) -> bool:
    """Every request's next token is the target's argmax and nothing else of its logits is read
    (greedy, no penalties, no logprobs): its forward may set ``ForwardBatch.greedy_only``."""
    return all(r.params.greedy and not r.params.has_penalties and not r.params.logprobs for r in reqs)


def sample_rows(out: ForwardOutput, reqs: list[Request]) -> list[tuple[int, TokenLogprob | None]]:
    """Sample one token per row of the forward's logits [B, V] (argmax-only requests: the rows'
    argmaxes, ``ForwardOutput.argmax_tokens``)."""
    if argmax_only(reqs):
        return [(t, None) for t in out.argmax_tokens()]
    return [sample_one(out.logits[i], r.params, r.generator, r.prompt_ids, r.output_ids) for i, r in enumerate(reqs)]


def prefill_chunks(batch: ScheduledBatch):
    """Forward chunks of a prefill: every uncached token of each request, into its reserved slots."""
    chunks = []
    for r, slots in zip(batch.reqs, batch.new_slots):
        start = r.num_cached
        ids = r.seq_ids[start:]
        chunks.append((torch.tensor(ids, dtype=torch.long), torch.arange(start, start + len(ids)), slots, r.slots.slots(), None))
    return chunks


def prefill_results(sampled: list[tuple[int, TokenLogprob | None]], batch: ScheduledBatch) -> list[StepResult]:
    """A prefill keeps the KV of every token it wrote and emits the one token sampled."""
    return [StepResult([t], list(range(int(s.numel()))), logprobs=[lp] if lp else []) for (t, lp), s in zip(sampled, batch.new_slots)]


class PlainWorker:
    slots_per_decode = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def run(self, batch: ScheduledBatch) -> list[StepResult]:
        return self.prefill(batch) if batch.is_prefill else self.decode(batch)

    def prefill(self, batch: ScheduledBatch) -> list[StepResult]:
        out = self.runner.forward(build_forward_batch(prefill_chunks(batch), last_only=True, greedy_only=argmax_only(batch.reqs)))
        return prefill_results(sample_rows(out, batch.reqs), batch)

    def decode(self, batch: ScheduledBatch) -> list[StepResult]:
        chunks = [
            (torch.tensor(r.seq_ids[-1:], dtype=torch.long), torch.tensor([r.num_cached]), slots[:1], r.slots.slots(), None)
            for r, slots in zip(batch.reqs, batch.new_slots)
        ]
        out = self.runner.forward(build_forward_batch(chunks, greedy_only=argmax_only(batch.reqs)))
        return [StepResult([t], [0], logprobs=[lp] if lp else []) for t, lp in sample_rows(out, batch.reqs)]

    def release(self, req: Request) -> None:
        """Drop any per-request worker state (none for plain decoding)."""

    def flush_cache(self) -> None:
        """Drop state learned from earlier requests (none for plain decoding)."""

    def capture_graphs(self) -> int:
        """The target's graphs for every row bucket (plain forwards tap no layer). Returns how many were made."""
        return self.runner.graphs.capture_all(())
