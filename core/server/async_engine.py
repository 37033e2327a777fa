"""The engine thread bridge.

The ``Engine`` is synchronous and not thread-safe, so exactly one background thread owns it. That
thread loops ``engine.step()`` while there is work and otherwise sleeps on a condition variable.
Everything else reaches the engine through a command queue drained between steps:

* ``submit(build)`` runs ``build(engine)`` (tokenization, validation, ``make_request``) on the
  engine thread, adds the requests and registers their output sinks *before* the next step, so no
  output can be missed; the awaiting coroutine gets a ``RequestGroup`` or the exception.
* ``abort(rids)`` aborts requests (client disconnects); their KV slots are freed by the engine.
* ``call(fn)`` / ``run(fn)`` run any ``fn(engine)`` on the engine thread.

Outputs of one step are grouped per event loop and handed over with one
``loop.call_soon_threadsafe`` per loop; each group has an ``asyncio.Queue`` of
``(index, RequestOutput | EngineFailure)``.

An exception inside the worker fails only the request that caused it (the engine finds it, see
``quarantine.py``); that request's client gets a 500 ``engine_error``. Anything else that raises in
a step fails the requests it may have touched (every running request, plus any whose request
vanished from the scheduler) with a 500 error; waiting requests continue and the thread keeps
serving. Draft KV slots left in use with no request in the engine are given back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from ..engine import Engine, RequestOutput
from ..request import Request
from ..draft_kv import draft_allocator, draft_kv_in_use, pair_cache
from .errors import APIError

logger = logging.getLogger("specfw.server")


@dataclass
class EngineFailure:
    """Delivered instead of a RequestOutput when the engine failed a request."""

    status: int
    message: str
    code: str = "engine_error"

    def error(self) -> APIError:
        return APIError(self.status, self.message, None, self.code)


@dataclass
class Snapshot:
    """Engine state taken on the engine thread after every step/command batch (read by /metrics)."""

    waiting: int = 0
    running: int = 0
    kv_used: int = 0
    kv_total: int = 0
    kv_usage: float = 0.0
    prefix_cache_tokens: int = 0  # KV slots the prefix cache holds (running requests' shared prefixes included)
    cache_hit_rate: float = 0.0  # share of prefilled tokens the prefix cache supplied
    draft_kv_used: int = 0  # the drafter's own KV pool (0/0 without one)
    draft_kv_total: int = 0
    verify_forwards: int = 0
    accepted_draft_tokens: int = 0
    proposed_draft_tokens: int = 0
    accept_length: float = 0.0
    position_accept: tuple = ()  # acceptance rate per draft depth (speculative)
    decode_steps: int = 0
    num_retracted: int = 0
    step_failures: int = 0


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    group: "RequestGroup"
    index: int


class RequestGroup:
    """The requests of one HTTP request (``n`` choices × prompts); iterate to get their outputs.

    Lives on the event loop that submitted it. ``on_finish(index, reason, output|None)`` is called
    once per request: with the engine's finish reason, ``"abort"`` after ``abort()``, or ``"error"``.
    """

    def __init__(self, bridge: "AsyncEngine", on_output: Callable | None = None, on_finish: Callable | None = None):
        self.bridge = bridge
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.arrival = time.monotonic()
        self._unfinished: set[int] = set()
        self._on_output, self._on_finish = on_output, on_finish

    def _bind(self, rids: list[str]) -> None:
        self.rids = list(rids)
        self._unfinished = set(range(len(rids)))

    @property
    def done(self) -> bool:
        return not self._unfinished

    def _finished(self, index: int, reason: str, out: RequestOutput | None) -> None:
        if index in self._unfinished:
            self._unfinished.discard(index)
            if self._on_finish:
                self._on_finish(index, reason, out)

    async def __aiter__(self):
        """Yields ``(index, RequestOutput)`` until every request finished; an engine failure aborts
        the rest of the group and raises its ``APIError``."""
        while self._unfinished:
            index, item = await self.queue.get()
            if index not in self._unfinished:
                continue
            if isinstance(item, EngineFailure):
                self._finished(index, "error", None)
                self.abort()
                raise item.error()
            if item.error:
                self._finished(index, "error", item)
                self.abort()
                raise APIError(500, f"Engine error: {item.error}", None, "engine_error")
            if self._on_output:
                self._on_output(index, item)
            if item.finished:
                self._finished(index, item.finish_reason or "stop", item)
            yield index, item

    async def collect(self) -> dict[int, list[RequestOutput]]:
        outs: dict[int, list[RequestOutput]] = defaultdict(list)
        async for index, out in self:
            outs[index].append(out)
        return outs

    def abort(self) -> None:
        """Abort every unfinished request of the group (no-op once all finished)."""
        if not self._unfinished:
            return
        rids = [self.rids[i] for i in sorted(self._unfinished)]
        for i in sorted(self._unfinished):
            self._finished(i, "abort", None)
        self.bridge.abort(rids)


class AsyncEngine:
    def __init__(self, engine: Engine | None):
        self.engine = engine
        self._cv = threading.Condition()
        self._cmds: list[tuple[str, Any]] = []
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.snapshot = Snapshot()
        self.step_failures = 0
        self.last_error: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    @classmethod
    def build(cls, factory: Callable[[], Engine]) -> "AsyncEngine":
        """Build the engine *on* the engine thread and start serving it; raises what ``factory``
        raised. Use this rather than ``AsyncEngine(Engine(...))`` when speed matters: torch's
        OpenMP runtime (libgomp) keeps one thread team per OS thread that ever ran a parallel
        op, and once the process holds more OpenMP threads than CPUs it stops spinning between
        ops, which made every decode step much slower (figures: docs/benchmarks.md, design figures) when the
        main thread built and warmed the engine and another thread then stepped it. Built here,
        all torch work stays on one OS thread (``torch.set_num_threads`` is per-thread too)."""
        self = cls(None)
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self.engine = factory()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                failure.append(e)
                return
            finally:
                ready.set()
            self._loop()

        with self._cv:
            self._thread = threading.Thread(target=run, name="specfw-engine", daemon=True)
            self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def start(self) -> "AsyncEngine":
        with self._cv:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="specfw-engine", daemon=True)
            self._thread.start()
        return self

    def request_stop(self) -> None:
        """Ask the thread to stop without waiting: pending requests fail with 503 at the end of the
        current step, so open streams end at once (``specfw serve`` calls this on SIGINT/SIGTERM)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread; pending requests fail with 503 (server shutting down)."""
        with self._cv:
            if self._thread is None:
                return
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- API for the event loop ---------------------------------------------------------
    def _post(self, kind: str, payload: Any) -> None:
        with self._cv:
            if self._stopping or self._thread is None:
                if kind == "submit":
                    raise APIError(503, "Server is shutting down", None, "shutting_down")
            self._cmds.append((kind, payload))
            self._cv.notify()

    async def submit(self, build: Callable[[Engine], list[Request]], group: RequestGroup) -> RequestGroup:
        """Run ``build(engine)`` on the engine thread and add its requests; returns ``group`` bound to
        their ids, or raises what ``build``/``add_request`` raised."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post("submit", (build, group, loop, fut))
        return await fut

    def abort(self, rids: list[str]) -> None:
        if rids:
            self._post("abort", list(rids))

    def call(self, fn: Callable[[Engine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread (fire and forget; runs at start if not started)."""
        self._post("call", fn)

    async def run(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` on the engine thread; its result once it ran. The metrics snapshot is
        taken again before the caller resumes, so what it reads next (``/metrics`` after
        ``/flush_cache``) shows what ``fn`` did (the loop's own snapshot comes after the reply)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def wrapped(engine):
            try:
                res = fn(engine)
                self._take_snapshot()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, res, None)

        self._post("call", wrapped)
        return await fut

    # ---- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        logger.debug("engine thread started")
        while True:
            with self._cv:
                while not self._cmds and not self._stopping and not self._has_work():
                    self._cv.wait()
                cmds, self._cmds = self._cmds, []
                stopping = self._stopping
            if stopping:
                for kind, payload in cmds:
                    self._run_command(kind, payload)
                try:
                    self._shutdown()
                except Exception:  # noqa: BLE001
                    logger.exception("engine thread: error during shutdown")
                return
            try:
                for kind, payload in cmds:
                    self._run_command(kind, payload)
                if self._has_work():
                    self._step()
                else:
                    self._reclaim_idle_draft_slots()
                self._take_snapshot()
            except Exception:  # noqa: BLE001 - the thread must outlive any bug
                logger.exception("engine thread: unexpected error (continuing)")
                time.sleep(0.1)

    def _has_work(self) -> bool:
        try:
            return self.engine.has_work
        except Exception:  # pragma: no cover - defensive
            return False

    def _run_command(self, kind: str, payload: Any) -> None:
        try:
            if kind == "submit":
                self._submit(*payload)
            elif kind == "abort":
                for rid in payload:
                    self._sinks.pop(rid, None)
                    self.engine.abort(rid)
            elif kind == "call":
                payload(self.engine)
        except Exception:
            logger.exception("engine command %s failed", kind)

    def _submit(self, build, group: RequestGroup, loop, fut) -> None:
        added: list[Request] = []
        try:
            reqs = build(self.engine)
            dup = [r.rid for r in reqs if r.rid in self._sinks]
            if dup or len({r.rid for r in reqs}) != len(reqs):
                raise APIError(400, f"request id {(dup or [reqs[0].rid])[0]!r} is already in use", "rid", "duplicate_request_id")
            for r in reqs:
                self.engine.add_request(r)
                added.append(r)
        except Exception as e:  # noqa: BLE001 - reported to the client
            for r in added:
                self.engine.abort(r.rid)
            if not isinstance(e, (ValueError, APIError)):
                logger.exception("building a request failed")
            _call_soon(loop, _settle, fut, None, e)
            return
        rids = [r.rid for r in reqs]
        for i, rid in enumerate(rids):
            self._sinks[rid] = _Sink(loop, group, i)

        def bind():
            group._bind(rids)
            if fut.cancelled():  # the client went away while we were queued
                group.abort()
            else:
                fut.set_result(group)

        if not _call_soon(loop, bind):
            self.abort_now(rids)

    def abort_now(self, rids: list[str]) -> None:
        for rid in rids:
            self._sinks.pop(rid, None)
            self.engine.abort(rid)

    def _step(self) -> None:
        try:
            outs = self.engine.step(deliver=self._deliver_during_step)
        except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
            self.step_failures += 1
            self.last_error = f"{type(e).__name__}: {e}"
            logger.exception("engine step failed; failing the affected requests")
            self._fail_after_step_error(e)
            return
        self._take_snapshot()  # before delivery: a client that got its answer sees fresh metrics
        self._deliver(outs)

    def _deliver(self, outs: list[RequestOutput], abort: Callable | None = None) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for out in outs:
            sink = self._sinks.pop(out.rid, None) if out.finished else self._sinks.get(out.rid)
            if sink is not None:
                per_loop[sink.loop].append((sink.group, sink.index, out))
        self._dispatch(per_loop, abort)

    def _deliver_during_step(self, outs: list[RequestOutput]) -> None:
        """The overlap scheduler's output thread streams the last step's outputs while the engine
        thread computes (the sinks are only changed between steps); a request to abort is posted
        as a command, not aborted from this thread."""
        self._deliver(outs, abort=self.abort)

    def _dispatch(self, per_loop, abort: Callable | None = None) -> None:
        for loop, items in per_loop.items():
            if not _call_soon(loop, _put_many, items):
                # that event loop is gone: nobody will read these requests any more
                (abort or self.abort_now)([out.rid for _, _, out in items if not isinstance(out, EngineFailure) and not out.finished])

    def _fail_after_step_error(self, exc: Exception) -> None:
        sched = self.engine.scheduler
        waiting = {r.rid for r in sched.waiting}
        failed = [rid for rid in self._sinks if rid not in waiting]
        for r in list(sched.running):
            try:
                self.engine.abort(r.rid)
            except Exception:  # pragma: no cover - last resort: drop it from the scheduler
                logger.exception("abort of %s failed", r.rid)
                sched.remove(r.rid)
        if sched.in_flight is not None:  # the step raised past the engine: undo its reservation
            sched.rollback(sched.in_flight)
        self._take_snapshot()
        per_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        failure = EngineFailure(500, f"Internal server error: engine step failed ({type(exc).__name__}: {exc})")
        for rid in failed:
            sink = self._sinks.pop(rid)
            per_loop[sink.loop].append((sink.group, sink.index, failure))
        self._dispatch(per_loop)

    def _reclaim_idle_draft_slots(self) -> None:
        """With no request in the engine every draft KV slot must be free; a failed draft step
        could otherwise leave some allocated."""
        alloc, leaked = draft_allocator(self.engine), draft_kv_in_use(self.engine)
        if alloc is None or not leaked:
            return
        logger.warning("reclaiming %d draft KV slots leaked by a failed step", leaked)
        cache = pair_cache(self.engine)
        if cache is not None:  # its slots go back with the rest
            cache.forget()
        type(alloc).__init__(alloc, alloc.num_slots)

    def _shutdown(self) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        failure = EngineFailure(503, "Server is shutting down", "shutting_down")
        for rid, sink in list(self._sinks.items()):
            per_loop[sink.loop].append((sink.group, sink.index, failure))
            try:
                self.engine.abort(rid)
            except Exception:  # pragma: no cover
                logger.exception("abort of %s at shutdown failed", rid)
        self._sinks.clear()
        self._dispatch(per_loop)
        with self._cv:
            for kind, payload in self._cmds:
                if kind == "submit":
                    _call_soon(payload[2], _settle, payload[3], None, APIError(503, "Server is shutting down", None, "shutting_down"))
            self._cmds.clear()
        self._take_snapshot()
        logger.debug("engine thread stopped")

    def _take_snapshot(self) -> None:
        e = self.engine
        alloc, st, draft = e.runner.allocator, e.stats, draft_allocator(e)
        self.snapshot = Snapshot(
            draft_kv_used=draft_kv_in_use(e) if draft else 0,
            draft_kv_total=draft.num_slots if draft else 0,
            waiting=len(e.scheduler.waiting),
            running=len(e.scheduler.running),
            kv_used=e.scheduler.kv_in_use,
            kv_total=alloc.num_slots,
            kv_usage=e.scheduler.kv_in_use / alloc.num_slots,
            prefix_cache_tokens=e.scheduler.cache.size if e.scheduler.cache is not None else 0,
            cache_hit_rate=e.scheduler.cache_hit_rate,
            verify_forwards=st.verify_forwards,
            accepted_draft_tokens=st.accepted_draft_tokens,
            proposed_draft_tokens=st.proposed_draft_tokens,
            accept_length=st.accept_length,
            decode_steps=st.decode_steps,
            position_accept=tuple(a / p if p else 0.0 for a, p in zip(st.position_accepts, st.position_proposals)),
            num_retracted=e.scheduler.num_retracted,
            step_failures=self.step_failures + st.step_failures,
        )


# ---- helpers run on the event loop ----------------------------------------------------------
def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # loop closed
        return False


def _settle(fut: asyncio.Future, result, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _put_many(items) -> None:
    for group, index, out in items:
        group.queue.put_nowait((index, out))
