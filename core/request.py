"""A generation request and its lifecycle state."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from .kv_cache import SlotTable
from .sampling import SamplingParams, make_generator

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    eos_token_ids: tuple[int, ...] = ()
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    slots: SlotTable = field(default_factory=SlotTable)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    cached_tokens: int | None = None  # prompt tokens its first prefill took from the prefix cache (None: not prefilled yet)
    final_text: str = ""
    # speculative decoding counters (spec_verify_ct, accepted draft tokens)
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0

    def __post_init__(self):
        self.generator: torch.Generator = make_generator(self.params.seed)

    @property
    def seq_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_cached(self) -> int:
        """Tokens whose KV is in the pool. The last sampled token is not cached yet."""
        return len(self.slots)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def spec_accept_length(self) -> float:
        """Tokens emitted per verify forward (bonus included)."""
        return (self.spec_accepted_tokens + self.spec_verify_ct) / self.spec_verify_ct if self.spec_verify_ct else 0.0
