"""Run a prompt set through an in-process engine at a concurrency level (closed loop: a new
request starts when one finishes) and measure it: tokens/s, TTFT, inter-token latency, accept
length and per-position acceptance (engine counters, before/after), peak memory."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tqdm import tqdm


@dataclass
class RunResult:
    """What one run measured; ``outputs`` are token ids (in-process) or texts (a server)."""

    outputs: list
    seconds: float
    output_tokens: int
    ttft: list[float] = field(default_factory=list)  # seconds, per request
    itl: list[float] = field(default_factory=list)  # seconds between successive token deliveries of a request
    accept_length: float | None = None
    per_position: list[float] = field(default_factory=list)
    peak_mem_mb: float | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


class PeakMemory:
    """Peak memory during a ``with`` block: CUDA's max allocated bytes on a GPU, else the
    process's resident set sampled every 20 ms (``/proc/self/statm``)."""

    def __init__(self, device):
        self.device, self.peak_mb = device, None

    def __enter__(self):
        if self.device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._stop = threading.Event()
        self._peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self._peak = max(self._peak, _rss())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            import torch

            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
            return
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self._peak, _rss()) / 2**20


def _rss() -> int:
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _spec_counters(stats) -> tuple:
    return stats.verify_forwards, stats.accepted_draft_tokens, list(stats.position_accepts), list(stats.position_proposals)


def run_engine(engine, prompts: list[list[int]], params, concurrency: int, desc: str) -> RunResult:
    """Keep ``concurrency`` requests in flight until every prompt ran; outputs in prompt order."""
    before = _spec_counters(engine.stats)
    pending = deque(enumerate(prompts))
    reqs, started, last, first = {}, {}, {}, set()
    ttft, itl = [], []
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False)
    with PeakMemory(engine.device) as mem:
        t0 = time.perf_counter()
        while pending or engine.has_work:
            while pending and len(started) < concurrency:
                i, ids = pending.popleft()
                req = engine.add_request(engine.make_request(ids, params))
                reqs[i], started[req.rid] = req, time.perf_counter()
            for o in engine.step():
                now = time.perf_counter()
                if o.new_token_ids:
                    if o.rid in first:
                        itl.append(now - last[o.rid])
                    else:
                        first.add(o.rid)
                        ttft.append(now - started[o.rid])
                    last[o.rid] = now
                if o.finished:
                    started.pop(o.rid, None)
                    bar.update()
        seconds = time.perf_counter() - t0
    bar.close()
    outputs = [list(reqs[i].output_ids) for i in range(len(prompts))]
    after = _spec_counters(engine.stats)
    v, acc = after[0] - before[0], after[1] - before[1]
    per_position = []
    for d, (a, p) in enumerate(zip(after[2], after[3])):
        a0, p0 = (before[2][d], before[3][d]) if d < len(before[2]) else (0, 0)
        if p > p0:
            per_position.append(round((a - a0) / (p - p0), 4))
    return RunResult(
        outputs=outputs,
        seconds=seconds,
        output_tokens=sum(len(o) for o in outputs),
        ttft=ttft,
        itl=itl,
        accept_length=(acc + v) / v if v else None,
        per_position=per_position,
        peak_mem_mb=mem.peak_mb,
    )
