"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, seeds and
repetition / frequency / presence penalties. ``target_probs`` is shared with speculative
verification so both paths transform logits identically."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


class SamplingParamsError(ValueError):
    """Invalid sampling parameter; ``param`` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self) -> "SamplingParams":
        def bad(param, msg):
            raise SamplingParamsError(param, f"{param}: {msg}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", f"must be a positive integer, got {self.max_new_tokens!r}")
        for name in _FLOATS:  # NaN passes every comparison below, so it is rejected first
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        for name in ("top_k", "top_logprobs"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                bad(name, f"must be an integer, got {getattr(self, name)!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.top_logprobs <= 20:
            bad("top_logprobs", f"must be in [0, 20], got {self.top_logprobs}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """logits [N, V] (rows share the same history). Repetition penalty over prompt+output (HF
    semantics); frequency/presence over output tokens (OpenAI semantics)."""
    if not p.has_penalties:
        return logits
    logits = logits.clone()
    if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        vals = logits[:, seen]
        logits[:, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output_ids and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p; logits [N, V] → probs [N, V]."""
    logits = logits.float() / max(p.temperature, 1e-5)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= p.top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # and the top token (top_p below float32's range)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def greedy_tokens(logits: torch.Tensor) -> list[int] | int:
    """The argmax of each row of ``logits`` [B, V] as Python ints (of one row [V]: an int), the first
    index of the maximum on ties. fp32 CPU rows go through numpy: torch's argmax takes ~60 us for
    a 49k-token row on 2 threads, numpy's ~4 us (every greedy step and verify reads one)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.argmax(logits.numpy(), axis=-1).tolist()
    return logits.argmax(-1).tolist()


def sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator, prompt_ids: list[int], output_ids: list[int]) -> tuple[int, TokenLogprob | None]:
    """Pick the next token from one row of logits [V] (on any device; sampled on the host, where
    the request's generator is)."""
    logits = apply_penalties(logits.cpu()[None], p, prompt_ids, output_ids)[0]
    if p.greedy:
        tok = greedy_tokens(logits.reshape(-1))
    else:
        tok = int(torch.multinomial(target_probs(logits[None], p)[0], 1, generator=gen))
    lp = None
    if p.logprobs:
        logp = torch.log_softmax(logits.float(), -1)
        top = []
        if p.top_logprobs:
            v, i = torch.topk(logp, p.top_logprobs)
            top = list(zip(i.tolist(), v.tolist()))
        lp = TokenLogprob(tok, float(logp[tok]), top)
    return tok, lp
