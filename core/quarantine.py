"""Finding the request whose step raised, so that only it fails.

A worker computes a whole batch at once, so an exception does not say which request caused it.
When a batch of several requests raises, the engine rolls every one of them back (KV freed,
worker state released, back to the front of the waiting queue, like a retraction: they recompute
later) and marks them *suspects*. A batch that holds a suspect runs that suspect alone; a suspect
that raises alone is the cause and fails with ``finish_reason="error"``, one that gets through a
step of the kind that failed (a prefill, or a decode after its prefill) is cleared. Every
failure either fails one request or turns a batch into suspects that each run alone next, so
this ends; the other requests keep their output (greedy decoding recomputes the same tokens).
"""

from __future__ import annotations

from .request import Request
from .scheduler import ScheduledBatch, Scheduler


class Quarantine:
    def __init__(self):
        self.suspects: dict[str, str] = {}  # rid → kind of the step that failed ("prefill" | "decode")

    def narrow(self, batch: ScheduledBatch, scheduler: Scheduler) -> ScheduledBatch:
        """The batch to run: unchanged, or its first suspect alone (the other requests of a
        prefill go back to the front of the queue; those of a decode wait this step out)."""
        if not self.suspects or len(batch.reqs) == 1:
            return batch
        alone = next((r for r in batch.reqs if r.rid in self.suspects), None)
        if alone is None:
            return batch
        return scheduler.narrow(batch, alone)

    def passed(self, batch: ScheduledBatch) -> None:
        if len(batch.reqs) == 1 and self.suspects.get(batch.reqs[0].rid) == batch.kind:
            del self.suspects[batch.reqs[0].rid]

    def suspect(self, batch: ScheduledBatch, scheduler: Scheduler) -> None:
        """Requeue the (rolled back) requests of a failed batch, in order, as suspects."""
        scheduler.requeue(batch.reqs)
        for r in batch.reqs:
            self.suspects.setdefault(r.rid, batch.kind)

    def forget(self, req: Request) -> None:
        self.suspects.pop(req.rid, None)
