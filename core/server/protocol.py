"""Request schemas (pydantic) for the OpenAI endpoints and SGLang's ``/generate``.

Booleans are strict (``"yes"`` is an error, not ``True``); numbers follow pydantic's lax rules
(``"5"`` is accepted as 5, ``1.5`` is not an int).

Unknown top-level fields are ignored (clients send things like ``user``); fields that would change
the output but are not supported (``tools``, ``logit_bias``, ``echo``, ...) are rejected with 400.
Range checks of sampling values are done by ``SamplingParams.validate`` so that the engine and the
server agree on them.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..sampling import SamplingParams
from .errors import APIError

MAX_N = 128
INT64_MIN, UINT64_MAX = -(2 ** 63), 2 ** 64 - 1


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None


class _SamplingFields(_Base):
    """Fields shared by chat and completions (OpenAI names plus SGLang/vLLM extras)."""
    model: Optional[str] = None
    n: int = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None       # None → 1.0 (OpenAI default)
    top_p: Optional[float] = None
    seed: Optional[int] = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # extras (SGLang / vLLM)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[int]] = None
    # accepted for compatibility, rejected when they would matter
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", "n", "invalid_value")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, logprobs: bool, top_logprobs: int) -> SamplingParams:
        """max_new_tokens is a placeholder; ``Submission`` fills it per prompt."""
        return SamplingParams(
            max_new_tokens=1, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop=self.stop_list(), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            logprobs=logprobs, top_logprobs=top_logprobs).validate()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs", "invalid_value")
        if self.tools:
            raise APIError(400, "tools are not supported", "tools", "unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", "response_format",
                           "unsupported_parameter")

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        """Messages as plain dicts for the chat template (text parts joined; ``developer`` → system)."""
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"only text content parts are supported, got '{part.type}'",
                                       f"messages.{i}.content", "unsupported_parameter")
                    texts.append(part.text)
                content = "".join(texts)
            else:
                content = m.content or ""
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None          # number of top logprobs per token (0 = only the chosen token)
    echo: StrictBool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo", "unsupported_parameter")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported", "best_of", "unsupported_parameter")
        if self.logprobs is not None and self.logprobs < 0:
            raise APIError(400, f"logprobs must be >= 0, got {self.logprobs}", "logprobs", "invalid_value")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt: the prompt is empty", "prompt", "invalid_value")

    def prompt_list(self) -> list[tuple[str, Any]]:
        """(kind, value) per prompt: a string, a token id list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [("text", p)]
        if all(isinstance(x, int) for x in p):
            return [("ids", list(p))]
        return [("text", x) if isinstance(x, str) else ("ids", list(x)) for x in p]


class GenerateSamplingParams(BaseModel):
    """SGLang ``sampling_params``; unknown keys are rejected."""
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: StrictBool = False
    seed: Optional[int] = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    sampling_seed: Optional[int] = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    n: int = 1
    skip_special_tokens: StrictBool = True


class GenerateRequest(_Base):
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: int = 0
    rid: Optional[str] = None

    def prompt_list(self) -> tuple[list[tuple[str, Any]], bool]:
        """((kind, value) per prompt, is_batch)."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "exactly one of 'text' and 'input_ids' must be given", "text", "invalid_value")
        if self.text is not None:
            if isinstance(self.text, str):
                return [("text", self.text)], False
            return [("text", t) for t in self.text], True
        ids = self.input_ids
        if ids and all(isinstance(x, list) for x in ids):
            return [("ids", list(x)) for x in ids], True
        return [("ids", list(ids))], False
