"""Continuous batching, and the one owner of the target's KV tables and of request states.

Per step the engine calls ``schedule()`` (admit waiting requests by KV capacity, retract the
newest running ones when the pool runs short, reserve this step's KV slots per request) and,
after the worker ran, ``update(batch, results)`` (keep the KV entries each result names, free
the rest of the reservation, append the emitted tokens, finish on eos / stop ids / length).
Workers read the reservation and return what happened (``step.StepResult``); they never
allocate, free or append KV slots. A failed step is undone with ``rollback(batch)``.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from .kv_cache import KVPool
from .request import Request, Status
from .step import StepResult

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class ScheduledBatch:
    kind: str  # "prefill" (new/retracted requests) or "decode" (running requests)
    reqs: list[Request]
    # per request, the KV slots this step may write (prefill: one per uncached token; decode:
    # ``slots_per_decode``, the largest tree); ``update`` keeps what the results say, frees the rest
    new_slots: list[torch.Tensor] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)  # moved back to the queue (drop their worker state)
    starved: list[Request] = field(default_factory=list)  # cannot grow in the pool: finish them ('length')

    @property
    def is_prefill(self) -> bool:
        return self.kind == "prefill"

    def only(self, req: Request) -> "ScheduledBatch":
        """This batch narrowed to one of its requests (and its reservation)."""
        i = self.reqs.index(req)
        return ScheduledBatch(self.kind, [req], [self.new_slots[i]] if self.new_slots else [])


@dataclass
class StepUpdate:
    """What ``update`` did for one request: the tokens appended, its output length after them and,
    if it finished, why."""

    new_tokens: list[int]
    finish_reason: str | None = None
    num_output: int = 0


class Scheduler:
    def __init__(
        self, kv: KVPool, max_running_requests: int, max_prefill_tokens: int, max_context: int, slots_per_decode: int = 1, max_queued_requests: int = 0
    ):
        self.kv = kv
        self.allocator = kv.allocator
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_context = max_context
        self.slots_per_decode = slots_per_decode  # 1 for plain decode, the largest tree for speculative
        self.max_queued = max_queued_requests  # 0 = unbounded
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retracted = 0
        self.in_flight: ScheduledBatch | None = None  # scheduled, neither updated nor rolled back yet

    # ---- queue management -------------------------------------------------------------
    def check(self, req: Request) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("prompt", "prompt is empty")
        if n >= self.max_context:
            raise RequestRejected("prompt", f"prompt has {n} tokens; the context length is {self.max_context}")
        if n + self.slots_per_decode > self.allocator.num_slots:
            raise RequestRejected("prompt", f"prompt has {n} tokens; the KV pool holds {self.allocator.num_slots}")
        if self.max_queued and len(self.waiting) >= self.max_queued:
            raise RequestRejected("queue", f"waiting queue is full ({self.max_queued} requests)")

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def remove(self, rid: str) -> Request | None:
        """Take a request out of the queue or the running set (its KV stays until ``finish``)."""
        for q in (self.waiting, self.running):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    return r
        return None

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """The request is done: out of the running set, its KV freed, its state final."""
        if req in self.running:
            self.running.remove(req)
        self._free(req)
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error

    def requeue(self, reqs: list[Request]) -> None:
        """Back to the front of the queue, in order (their KV is already freed)."""
        for r in reversed(reqs):
            if r in self.running:
                self.running.remove(r)
            r.status = Status.WAITING
            self.waiting.appendleft(r)

    def _free(self, req: Request) -> None:
        self.allocator.free(req.slots.truncate(0))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        if self.in_flight is not None:  # the last step neither finished nor rolled back (it raised)
            self.rollback(self.in_flight)
        batch = self._schedule_prefill()
        if batch is None:
            if not self.running:
                return None
            batch = ScheduledBatch("decode", [])
            batch.retracted = self._make_room_for_decode()
            batch.starved = self._starved()
            batch.reqs = list(self.running)
            batch.new_slots = [self.allocator.alloc(self.slots_per_decode) for _ in batch.reqs]
        self.in_flight = batch
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        picked, tokens = [], 0
        reserve = self.slots_per_decode * len(self.running)
        while self.waiting and len(self.running) + len(picked) < self.max_running:
            req = self.waiting[0]
            need = req.seq_len
            if picked and tokens + need > self.max_prefill_tokens:
                break
            reserve_after = reserve + self.slots_per_decode * (len(picked) + 1)
            if tokens + need + reserve_after > self.allocator.num_free:
                break
            picked.append(self.waiting.popleft())
            tokens += need
        if not picked:
            return None
        for r in picked:
            r.status = Status.RUNNING
        self.running.extend(picked)
        return ScheduledBatch("prefill", picked, [self.allocator.alloc(r.seq_len - r.num_cached) for r in picked])

    def _make_room_for_decode(self) -> list[Request]:
        """Retract the newest requests until every running one can get its decode slots."""
        retracted = []
        while self.slots_per_decode * len(self.running) > self.allocator.num_free and len(self.running) > 1:
            victim = self.running.pop()
            self._free(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            self.num_retracted += 1
            retracted.append(victim)
            logger.warning("KV pool full: retracted %s (%d tokens) to recompute later", victim.rid, victim.seq_len)
        return retracted

    def _starved(self) -> list[Request]:
        """A lone running request the pool cannot grow any further (it holds the rest)."""
        if self.allocator.num_free >= self.slots_per_decode * len(self.running):
            return []
        starved = list(self.running)
        for r in starved:
            logger.warning("KV pool exhausted: finishing %s at %d tokens", r.rid, r.seq_len)
            self.running.remove(r)
        return starved

    def narrow(self, batch: ScheduledBatch, req: Request) -> ScheduledBatch:
        """Run only ``req`` of ``batch`` this step: the others' reservations are freed; the other
        requests of a prefill go back to the front of the queue, those of a decode wait."""
        for r, slots in zip(batch.reqs, batch.new_slots):
            if r is not req:
                self.allocator.free(slots)
        if batch.is_prefill:
            self.requeue([r for r in batch.reqs if r is not req])
        self.in_flight = batch.only(req)
        return self.in_flight

    # ---- after the step -----------------------------------------------------------------
    def update(self, batch: ScheduledBatch, results: list[StepResult]) -> list[StepUpdate]:
        """Apply the step: per request keep the KV entries ``kv_keep`` names (moved to the front
        of its reservation, appended to its table), free the rest, append the tokens (up to eos,
        a stop id or ``max_new_tokens``) and finish the request if one of those, or the context
        length, is reached."""
        updates = []
        for req, slots, res in zip(batch.reqs, batch.new_slots, results):
            self._keep_kv(req, slots, res.kv_keep)
            new, reason = self._append_tokens(req, res.tokens)
            if reason is None and req.seq_len >= self.max_context:
                reason = "length"
            if reason is not None:
                self.finish(req, reason)
            updates.append(StepUpdate(new, reason, len(req.output_ids)))
        self.in_flight = None
        return updates

    def _keep_kv(self, req: Request, slots: torch.Tensor, keep: list[int]) -> None:
        """The kept entries move to the first ``len(keep)`` slots of the reservation (kept
        entries come in tree order, so each moves to an earlier or the same slot): a request's
        KV stays one ascending run where it was one, and attention reads it as a view."""
        k = len(keep)
        if keep != list(range(k)):
            self.kv.move(slots[torch.tensor(keep, dtype=torch.long)], slots[:k])
        req.slots.append(slots[:k])
        self.allocator.free(slots[k:])

    @staticmethod
    def _append_tokens(req: Request, tokens: list[int]) -> tuple[list[int], str | None]:
        new = []
        for tok in tokens:
            req.output_ids.append(tok)
            new.append(tok)
            if tok in req.eos_token_ids or tok in req.params.stop_token_ids:
                return new, "stop"
            if len(req.output_ids) >= req.params.max_new_tokens:
                return new, "length"
        return new, None

    def rollback(self, batch: ScheduledBatch) -> None:
        """Undo a step that raised: its reservations freed; its requests out of the running set
        with their KV freed (they recompute when they run again)."""
        for slots in batch.new_slots:
            self.allocator.free(slots)
        batch.new_slots = []
        for r in batch.reqs:
            if r in self.running:
                self.running.remove(r)
            self._free(r)
        self.in_flight = None
