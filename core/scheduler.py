"""Continuous batching, and the one owner of the target's KV tables and of request states.

Per step the engine calls ``schedule()`` (admit waiting requests by KV capacity, retract the
newest running ones when the pool runs short, reserve this step's KV slots per request) and,
after the worker ran, ``update(batch, results)`` (keep the KV entries each result names, free
the rest of the reservation, append the emitted tokens, finish on eos / stop ids / length).
Workers read the reservation and return what happened (``step.StepResult``); they never
allocate, free or append KV slots. A failed step is undone with ``rollback(batch)``.

With a prefix cache (``core/prefix_cache.py``, on unless ``engine.disable_radix_cache``) a
request admitted to prefill starts from the longest cached prefix of its tokens (those slots
shared and locked while it runs; only the rest is prefilled), and a finished or retracted
request's KV goes to the cache instead of the free list; cached slots no request holds are
evicted, least recently used first, whenever the free list runs short.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from .kv_cache import KVPool
from .prefix_cache import PrefixCache, PrefixMatch
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
        self,
        kv: KVPool,
        max_running_requests: int,
        max_prefill_tokens: int,
        max_context: int,
        slots_per_decode: int = 1,
        max_queued_requests: int = 0,
        prefix_cache: PrefixCache | None = None,
        prefix_to_reuse=None,
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
        self.cache = prefix_cache
        # (request, cached tokens) -> how many to reuse: a drafter that continues from target
        # features asks the target to recompute those its own cached state does not reach
        # (the worker's ``prefix_to_reuse``, hook ``specfw_prefix_to_reuse``); None: all
        self.prefix_to_reuse = prefix_to_reuse
        self._hits: dict[str, PrefixMatch] = {}  # per running request, its locked cached prefix
        self.prefill_cached_tokens = 0  # prefilled requests' tokens taken from the prefix cache, all time (counted in update)
        self.prefill_computed_tokens = 0  # and those the target computed

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
        """The request is done: out of the running set, its KV freed (or cached), its state final."""
        if req in self.running:
            self.running.remove(req)
        self._free(req, keep=reason != "error")
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error

    def requeue(self, reqs: list[Request]) -> None:
        """Back to the front of the queue, in order (their KV is already freed)."""
        for r in reversed(reqs):
            if r in self.running:
                self.running.remove(r)
            r.status = Status.WAITING
            self.waiting.appendleft(r)

    def _free(self, req: Request, keep: bool = True) -> None:
        """Give up the request's KV: to the prefix cache (``keep``: every entry is final) or the
        free list; the cached prefix it started from is unlocked."""
        slots = req.slots.truncate(0)
        hit = self._hits.pop(req.rid, None)
        if self.cache is None:
            self.allocator.free(slots)
            return
        own = hit.length if hit is not None else 0  # slots[:own] are the tree's
        # a step may have kept KV past a token it did not append (cut at max_new_tokens or a stop)
        n = min(int(slots.numel()), req.seq_len) if keep else own
        if n > own:
            self.allocator.free(slots[own : self.cache.insert(req.seq_ids[:n], slots[:n])])
        self.allocator.free(slots[max(n, own) :])
        if hit is not None:
            self.cache.unlock(hit.node)

    def _reclaim(self, n: int) -> bool:
        """At least ``n`` free slots, evicting unlocked cached prefixes if need be; whether it got them."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None and self.cache.evictable:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.num_free >= n

    def _room(self) -> int:
        """Slots free now or after evicting every unlocked cached prefix."""
        return self.allocator.num_free + (self.cache.evictable if self.cache is not None else 0)

    def _start_from_cache(self, req: Request) -> bool:
        """Point a request about to prefill at the longest cached prefix of its tokens (at least its
        last token is computed: its logits give the next); whether it took one now (a request
        put back by ``narrow`` keeps the prefix it holds)."""
        if self.cache is None or req.num_cached:
            return False
        hit = self.cache.match(req.seq_ids[: req.seq_len - 1])
        use = min(hit.length, self.prefix_to_reuse(req, hit.length)) if self.prefix_to_reuse and hit.length else hit.length
        if use <= 0:
            return False
        if use < hit.length:  # the same node stays locked: it covers the shorter prefix too
            hit = PrefixMatch(hit.slots[:use], hit.node)
        self.cache.lock(hit.node)
        self._hits[req.rid] = hit
        req.slots.append(hit.slots)
        return True

    def _forget_start(self, req: Request) -> None:
        """Undo ``_start_from_cache`` for a request that stays in the queue."""
        hit = self._hits.pop(req.rid, None)
        if hit is not None:
            req.slots.truncate(0)
            self.cache.unlock(hit.node)

    @property
    def cache_hit_rate(self) -> float:
        """Share of prefilled tokens the prefix cache supplied (SGLang's ``cache_hit_rate``)."""
        total = self.prefill_cached_tokens + self.prefill_computed_tokens
        return self.prefill_cached_tokens / total if total else 0.0

    @property
    def kv_in_use(self) -> int:
        """Slots running requests hold (allocated, less the cache's unlocked entries)."""
        return self.allocator.num_used - (self.cache.evictable if self.cache is not None else 0)

    def flush_cache(self) -> bool:
        """Empty the prefix cache (only with no request running or waiting)."""
        if self.cache is None or self.has_work:
            return self.cache is None
        self.allocator.free(self.cache.reset())
        return True

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
            took = self._start_from_cache(req)
            need = req.seq_len - req.num_cached
            reserve_after = reserve + self.slots_per_decode * (len(picked) + 1)
            if (picked and tokens + need > self.max_prefill_tokens) or tokens + need + reserve_after > self._room():
                if took:
                    self._forget_start(req)
                break
            picked.append(self.waiting.popleft())
            tokens += need
            if req.cached_tokens is None and self.cache is not None:
                req.cached_tokens = min(req.num_cached, len(req.prompt_ids))
        if not picked:
            return None
        for r in picked:
            r.status = Status.RUNNING
        self.running.extend(picked)
        self._reclaim(tokens)
        return ScheduledBatch("prefill", picked, [self.allocator.alloc(r.seq_len - r.num_cached) for r in picked])

    def _make_room_for_decode(self) -> list[Request]:
        """Retract the newest requests until every running one can get its decode slots."""
        retracted = []
        while not self._reclaim(self.slots_per_decode * len(self.running)) and len(self.running) > 1:
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
        if self._reclaim(self.slots_per_decode * len(self.running)):
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
        if batch.is_prefill:  # counted once a prefill has run (not when a failed or narrowed batch is put back)
            self.prefill_computed_tokens += sum(len(slots) for slots in batch.new_slots)
            self.prefill_cached_tokens += sum(r.num_cached for r in batch.reqs)
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
            self._free(r, keep=False)
        self.in_flight = None
