"""Engine statistics: counters for /metrics and SGLang-style periodic log lines."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

logger = logging.getLogger("specfw")


class Load(NamedTuple):
    """The engine's load after a step (for the log lines)."""

    running: int
    waiting: int
    kv_used: int
    kv_usage: float


@dataclass
class EngineStats:
    num_requests: int = 0
    num_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    decode_steps: int = 0
    verify_forwards: int = 0
    accepted_draft_tokens: int = 0
    proposed_draft_tokens: int = 0
    step_failures: int = 0  # worker steps that raised (see quarantine.py)
    position_accepts: list[int] = field(default_factory=list)  # accepted count per draft depth
    position_proposals: list[int] = field(default_factory=list)
    _window_tokens: int = 0
    _window_start: float = field(default_factory=time.monotonic)
    _window_verify: int = 0
    _window_emitted: int = 0
    observers: list = field(default_factory=list)  # callables(event, **kw), e.g. Prometheus metrics
    decode_log_interval: int = 40  # a decode log line every this many decode steps

    def _emit(self, event: str, **kw) -> None:
        for obs in self.observers:
            obs(event, **kw)

    def on_arrival(self) -> None:
        self.num_requests += 1
        self._emit("arrival")

    def on_first_token(self, ttft: float) -> None:
        self._emit("first_token", ttft=ttft)

    def on_finish(self, req) -> None:
        self.num_finished += 1
        self._emit("finish", req=req)

    def on_step(self, batch, results, seconds: float, load: "Load") -> None:
        emitted = sum(len(r.tokens) for r in results)
        if batch.is_prefill:
            new_tokens = sum(r.seq_len for r in batch.reqs)
            self.prompt_tokens += new_tokens
            computed = sum(int(s.numel()) for s in batch.new_slots)  # the rest came from the prefix cache
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, #running-req: %d, #queue-req: %d, token usage: %.2f",
                len(batch.reqs),
                computed,
                max(0, sum(r.seq_len - 1 for r in batch.reqs) - computed),
                load.running,
                load.waiting,
                load.kv_usage,
            )
        else:
            self.decode_steps += 1
            self._window_tokens += emitted
            spec = [r for r in results if r.num_draft]
            if spec:
                self.verify_forwards += len(spec)
                self._window_verify += len(spec)
                self._window_emitted += sum(len(r.tokens) for r in spec)
                self.proposed_draft_tokens += sum(r.num_draft for r in spec)
                self.accepted_draft_tokens += sum(r.num_accepted for r in spec)
            if self.decode_steps % self.decode_log_interval == 0:
                self._log_decode(load)
        self.generation_tokens += emitted
        self._emit("step", kind=batch.kind, tokens=emitted, seconds=seconds, batch_size=len(batch.reqs))

    def record_positions(self, verifies: list[tuple[int, int]]) -> None:
        """Per-position acceptance from (accepted draft tokens k, tree depth) per verify: the
        positions 0..depth-1 were proposed, 0..k-1 accepted."""
        for k, depth in verifies:
            while len(self.position_proposals) < depth:
                self.position_proposals.append(0)
                self.position_accepts.append(0)
            for d in range(depth):
                self.position_proposals[d] += 1
                if d < k:
                    self.position_accepts[d] += 1

    def _log_decode(self, load: "Load") -> None:
        now = time.monotonic()
        thr = self._window_tokens / max(now - self._window_start, 1e-9)
        msg = f"Decode batch. #running-req: {load.running}, #token: {load.kv_used}, token usage: {load.kv_usage:.2f}, "
        if self._window_verify:
            msg += f"accept len: {self._window_emitted / self._window_verify:.2f}, "
        msg += f"gen throughput (token/s): {thr:.2f}, #queue-req: {load.waiting}"
        logger.info(msg)
        self._window_tokens, self._window_start, self._window_verify, self._window_emitted = 0, now, 0, 0

    @property
    def accept_length(self) -> float:
        if not self.verify_forwards:
            return 0.0
        return (self.accepted_draft_tokens + self.verify_forwards) / self.verify_forwards

    @property
    def accept_rate(self) -> float:
        return self.accepted_draft_tokens / self.proposed_draft_tokens if self.proposed_draft_tokens else 0.0
