"""Turn validated API fields into engine ``Request`` objects, in two phases:

* ``prepare(engine)`` runs on the tokenizer thread (``state.py``), never on the engine thread, so a
  long prompt or chat template cannot stall running streams: it tokenizes, checks token ids and
  lengths and fixes ``max_new_tokens`` per prompt. It reads only what never changes (tokenizer,
  context length, KV pool size, vocabulary).
* ``build(engine)`` runs on the engine thread: the queue bound and ``make_request`` per choice.

``max_tokens`` rules (documented in README "Serve"): with ``room`` = the tokens that can follow the
prompt, i.e. ``min(context_length - prompt_tokens, KV pool room)`` (the pool must hold the prompt,
the completion and one decode step's slots):

* given: must be >= 1 and at most ``room``, else 400 ``context_length_exceeded``;
* omitted: ``min(room, default_max_tokens)`` (``DEFAULT_MAX_TOKENS`` = 4096 for the OpenAI
  endpoints, 128 for SGLang's ``/generate`` like SGLang).

With ``n`` choices and ``seed = s`` the choices use seeds ``s, s+1, ...`` (different samples,
each reproducible).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import Engine
from ..request import Request
from ..sampling import SamplingParams, SamplingParamsError
from ..scheduler import RequestRejected
from .errors import APIError

DEFAULT_MAX_TOKENS = 4096
_SEED_MOD = 2**64


@dataclass
class Prompt:
    """One prompt: ``text`` (str), ``ids`` (token ids) or ``chat`` (list of message dicts)."""

    kind: str
    value: Any


def context_error(param: str, message: str) -> APIError:
    return APIError(400, message, param, "context_length_exceeded")


@dataclass
class Submission:
    prompts: list[Prompt]
    params: SamplingParams  # max_new_tokens is filled in per prompt
    n: int = 1
    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    prompt_param: str = "prompt"  # field names used in error messages
    max_tokens_param: str = "max_tokens"
    stop_ids_param: str = "stop_token_ids"
    rid_prefix: str = "req"
    prompt_ids: list[list[int]] = field(default_factory=list)  # filled by prepare()
    max_new: list[int] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.prompts) * self.n

    def prepare(self, engine: Engine) -> "Submission":
        vocab = engine.runner.vocab_size
        if any(t >= vocab for t in self.params.stop_token_ids):
            raise APIError(400, f"{self.stop_ids_param}: token ids must be in [0, {vocab})", self.stop_ids_param, "invalid_value")
        for prompt in self.prompts:
            ids = self._tokenize(engine, prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
                raise APIError(400, f"{self.prompt_param}: token ids must be in [0, {vocab})", self.prompt_param, "invalid_value")
            if not ids:
                raise APIError(400, f"{self.prompt_param}: the prompt is empty", self.prompt_param, "invalid_value")
            room = self._room(engine, len(ids))
            if self.max_tokens is None:
                max_new = min(room, self.default_max_tokens)
            elif self.max_tokens > room:
                raise context_error(self.max_tokens_param, self._too_long(engine, len(ids), room))
            else:
                max_new = self.max_tokens
            self.prompt_ids.append(ids)
            self.max_new.append(max_new)
        return self

    def _room(self, engine: Engine, prompt_tokens: int) -> int:
        ctx = engine.runner.max_context
        if prompt_tokens >= ctx:
            raise context_error(
                self.prompt_param,
                f"This model's maximum context length is {ctx} tokens; the prompt "
                f"has {prompt_tokens} tokens (at least one token must remain for the completion)",
            )
        # the last step caches all but the last sampled token and needs slots_per_decode fresh slots
        pool_room = engine.runner.allocator.num_slots - prompt_tokens - engine.worker.slots_per_decode + 2
        if pool_room < 1:
            raise context_error(self.prompt_param, f"the prompt has {prompt_tokens} tokens; the KV pool holds {engine.runner.allocator.num_slots}")
        return min(ctx - prompt_tokens, pool_room)

    def _too_long(self, engine: Engine, prompt_tokens: int, room: int) -> str:
        return (
            f"{self.max_tokens_param} is too large: {self.max_tokens}. This model's maximum context length is "
            f"{engine.runner.max_context} tokens (KV pool: {engine.runner.allocator.num_slots}) and the prompt "
            f"has {prompt_tokens} tokens, so at most {room} can be generated"
        )

    def build(self, engine: Engine) -> list[Request]:
        """Requests in choice order: prompt-major, then the ``n`` samples of each prompt."""
        bound = engine.scheduler.max_queued
        if bound and self.num_requests > bound:
            raise APIError(
                400,
                f"this request needs {self.num_requests} engine requests (n x prompts) but the queue holds at most {bound} (engine.max_queued_requests)",
                "n",
                "invalid_value",
            )
        reqs = []
        for pi, (ids, max_new) in enumerate(zip(self.prompt_ids, self.max_new)):
            for j in range(self.n):
                seed = self.params.seed
                if seed is not None and j:
                    seed = (seed + j) % _SEED_MOD
                p = dataclasses.replace(
                    self.params, max_new_tokens=max_new, seed=seed, stop=list(self.params.stop), stop_token_ids=list(self.params.stop_token_ids)
                )
                try:
                    reqs.append(engine.make_request(ids, p, rid=f"{self.rid_prefix}-{pi * self.n + j}"))
                except RequestRejected as e:
                    if e.param == "prompt" and self.prompt_param != "prompt":
                        raise RequestRejected(self.prompt_param, str(e)) from e
                    raise
                except SamplingParamsError as e:
                    if e.param == "max_new_tokens":
                        raise SamplingParamsError(self.max_tokens_param, str(e).replace("max_new_tokens", self.max_tokens_param)) from e
                    raise
        return reqs

    def _tokenize(self, engine: Engine, prompt: Prompt) -> list[int]:
        if prompt.kind == "chat":
            return engine.tokenize_chat(prompt.value)
        if prompt.kind == "text":
            return list(engine.tokenizer(prompt.value)["input_ids"])
        return list(prompt.value)


BuildFn = Callable[[Engine], list[Request]]
