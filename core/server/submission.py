"""Turn validated API fields into engine ``Request`` objects (runs on the engine thread).

Prompts are tokenized here, on the engine thread, so the tokenizer is never used concurrently for
encoding. ``max_tokens`` rules (documented in README "Serve"):

* given: must be >= 1 and ``prompt_tokens + max_tokens`` must fit the context length, else 400;
* omitted: ``min(context_length - prompt_tokens, default_max_tokens)`` (``DEFAULT_MAX_TOKENS``
  = 4096 for the OpenAI endpoints, 128 for SGLang's ``/generate`` like SGLang).

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
_SEED_MOD = 2 ** 64


@dataclass
class Prompt:
    """One prompt: ``text`` (str), ``ids`` (token ids) or ``chat`` (list of message dicts)."""
    kind: str
    value: Any


@dataclass
class Submission:
    prompts: list[Prompt]
    params: SamplingParams              # max_new_tokens is filled in per prompt
    n: int = 1
    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    prompt_param: str = "prompt"        # field names used in error messages
    max_tokens_param: str = "max_tokens"
    rid_prefix: str = "req"
    prompt_ids: list[list[int]] = field(default_factory=list)   # filled by build()

    def build(self, engine: Engine) -> list[Request]:
        """Requests in choice order: prompt-major, then the ``n`` samples of each prompt."""
        reqs = []
        ctx = engine.runner.max_context
        vocab = engine.runner.vocab_size
        for pi, prompt in enumerate(self.prompts):
            ids = self._tokenize(engine, prompt)
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
                raise APIError(400, f"{self.prompt_param}: token ids must be in [0, {vocab})", self.prompt_param)
            if not ids:
                raise RequestRejected(self.prompt_param, f"{self.prompt_param}: the prompt is empty")
            if len(ids) >= ctx:
                raise RequestRejected(self.prompt_param,
                                      f"This model's maximum context length is {ctx} tokens; the prompt has "
                                      f"{len(ids)} tokens (at least one token must remain for the completion)")
            remaining = ctx - len(ids)
            if self.max_tokens is None:
                max_new = min(remaining, self.default_max_tokens)
            elif self.max_tokens > remaining:
                raise RequestRejected(self.max_tokens_param,
                                      f"{self.max_tokens_param} is too large: {self.max_tokens}. This model's "
                                      f"maximum context length is {ctx} tokens and the prompt has {len(ids)} "
                                      f"tokens, so at most {remaining} can be generated")
            else:
                max_new = self.max_tokens
            self.prompt_ids.append(ids)
            for j in range(self.n):
                seed = self.params.seed
                if seed is not None and j:
                    seed = (seed + j) % _SEED_MOD
                p = dataclasses.replace(self.params, max_new_tokens=max_new, seed=seed,
                                        stop=list(self.params.stop), stop_token_ids=list(self.params.stop_token_ids))
                try:
                    reqs.append(engine.make_request(ids, p, rid=f"{self.rid_prefix}-{pi * self.n + j}"))
                except RequestRejected as e:
                    if e.param == "prompt" and self.prompt_param != "prompt":
                        raise RequestRejected(self.prompt_param, str(e)) from e
                    raise
                except SamplingParamsError as e:
                    if e.param == "max_new_tokens":
                        raise SamplingParamsError(self.max_tokens_param, str(e).replace(
                            "max_new_tokens", self.max_tokens_param)) from e
                    raise
        return reqs

    def _tokenize(self, engine: Engine, prompt: Prompt) -> list[int]:
        if prompt.kind == "chat":
            return engine.tokenize_chat(prompt.value)
        if prompt.kind == "text":
            return list(engine.tokenizer(prompt.value)["input_ids"])
        return list(prompt.value)


def check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise APIError(400, f"{param} must be at least 1, got {value}", param, "invalid_value")


BuildFn = Callable[[Engine], list[Request]]
