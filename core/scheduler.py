"""Continuous batching: a waiting queue, a running set, admission by KV capacity, and
retraction (recompute later) when the pool runs short during decode."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from .kv_cache import SlotAllocator
from .request import Request, Status

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class ScheduledBatch:
    kind: str                 # "prefill" (new/retracted requests) or "decode" (running requests)
    reqs: list[Request]

    @property
    def is_prefill(self) -> bool:
        return self.kind == "prefill"


class Scheduler:
    def __init__(self, allocator: SlotAllocator, max_running_requests: int, max_prefill_tokens: int,
                 max_context: int, slots_per_decode: int = 1, max_queued_requests: int = 0):
        self.allocator = allocator
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_context = max_context
        self.slots_per_decode = slots_per_decode   # 1 for plain decode, tree size for speculative
        self.max_queued = max_queued_requests      # 0 = unbounded
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retracted = 0
        self.on_retract = lambda req: None        # the worker drops per-request state (draft KV)

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
        for q in (self.waiting, self.running):
            for r in q:
                if r.rid == rid:
                    q.remove(r)
                    return r
        return None

    def free(self, req: Request) -> None:
        self.allocator.free(req.slots.truncate(0))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        if not self.running:
            return None
        self._make_room_for_decode()
        return ScheduledBatch("decode", list(self.running))

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
        return ScheduledBatch("prefill", picked)

    def _make_room_for_decode(self) -> None:
        """Retract the newest requests until every running one can get its decode slots."""
        while self.slots_per_decode * len(self.running) > self.allocator.num_free and len(self.running) > 1:
            victim = self.running.pop()
            self.free(victim)
            self.on_retract(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            self.num_retracted += 1
            logger.warning("KV pool full: retracted %s (%d tokens) to recompute later", victim.rid, victim.seq_len)
