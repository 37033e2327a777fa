"""What one step produced for one request: the one result type from a worker to the scheduler
and the engine (and what ``specfw_verify`` returns).

A step writes the KV of its new tokens into the slots the scheduler reserved for the request
(``ScheduledBatch.new_slots``), in the order of the forward's rows. ``kv_keep`` says which of
those entries the sequence keeps, in sequence order: a prefill keeps all of them, a plain decode
its one, a speculative decode the accepted path of its tree (root first). The scheduler applies
it (``Scheduler.update``): the kept entries move to the front of the reservation, join the
request's KV table, and the rest of the reservation is freed. Workers never touch KV tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepResult:
    tokens: list[int]  # tokens to emit (accepted drafts + bonus, or the one sampled)
    kv_keep: list[int]  # indices into the step's reserved slots kept, in sequence order
    num_draft: int = 0  # draft tokens verified (0: no draft this step)
    logprobs: list = field(default_factory=list)
    node_rows: torch.Tensor | None = None  # rows of the forward for kv_keep (speculative: set by the worker)

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (0 without a draft)."""
        return len(self.kv_keep) - 1 if self.num_draft else 0


class VerifyResult(StepResult):
    """``specfw_verify``'s answer: the accepted path (tree node indices, root first) and the tokens
    to emit (accepted draft tokens + bonus). A :class:`StepResult` whose kept KV is that path."""

    def __init__(self, accepted_nodes: list[int], tokens: list[int], num_draft: int, node_rows: torch.Tensor | None = None, logprobs: list | None = None):
        super().__init__(list(tokens), list(accepted_nodes), num_draft, list(logprobs or []), node_rows)

    @property
    def accepted_nodes(self) -> list[int]:
        return self.kv_keep

    @property
    def num_accepted(self) -> int:
        return len(self.kv_keep) - 1
