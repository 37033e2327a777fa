"""Request schemas (pydantic) for the OpenAI endpoints and SGLang's ``/generate``.

Every limit a request must meet is stated in its field type (``fields.py``), so the published
OpenAPI schema shows it and validation enforces it; ``SamplingParams.validate`` checks the same
ranges again for the engine's other callers. The limits no schema can state are checked when the
request is built: prompt tokens + ``max_tokens`` against the context and the KV pool (400
``context_length_exceeded``) and the number of engine requests against the queue bound.

Unknown top-level fields are ignored (clients send things like ``user``); fields that would change
the output but are not supported (``tools``, ``logit_bias``, ``echo``, ...) are accepted only with
their neutral value, anything else is a 400 ``unsupported_parameter``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..sampling import SamplingParams
from .errors import APIError
from .fields import (
    MAX_N,
    STRICT,
    Choices,
    Int,
    MaxTokens,
    MinP,
    Penalty,
    PromptText,
    RepetitionPenalty,
    Seed,
    Temperature,
    Text,
    TokenId,
    TokenIds,
    TopK,
    TopLogprobs,
    TopP,
    empty,
    only,
)

__all__ = ["MAX_N", "ChatCompletionRequest", "CompletionRequest", "GenerateRequest"]


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)


class StreamOptions(_Base):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    type: Annotated[(str, *only("content part type", "text"))]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Optional[Text] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", **STRICT)
    type: Annotated[(str, *only("response_format type", "text"))] = "text"


def _unsupported_list(name: str):
    return Annotated[Optional[list[Any]], empty(name), Field(json_schema_extra={"maxItems": 0})]


class _SamplingFields(_Base):
    """Fields shared by chat and completions (OpenAI names plus SGLang/vLLM extras)."""

    model: Optional[Text] = None
    n: Choices = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[Text, list[Text], None] = None
    max_tokens: Optional[MaxTokens] = None
    temperature: Optional[Temperature] = None  # None → 1.0 (OpenAI default)
    top_p: Optional[TopP] = None
    seed: Optional[Seed] = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    # extras (SGLang / vLLM)
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[TokenId]] = None
    # accepted for compatibility, rejected when they would matter
    logit_bias: Annotated[Optional[dict[str, float]], empty("logit_bias"), Field(json_schema_extra={"maxProperties": 0})] = None
    user: Optional[Text] = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, logprobs: bool, top_logprobs: int) -> SamplingParams:
        """max_new_tokens is a placeholder; ``Submission`` fills it per prompt."""
        return SamplingParams(
            max_new_tokens=1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        ).validate()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# top_logprobs > 0 needs logprobs: true (JSON Schema 2020-12 if/then, so the schema says so too)
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=_TOP_LOGPROBS_NEED_LOGPROBS)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[MaxTokens] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[TopLogprobs] = None
    tools: _unsupported_list("tools") = None
    tool_choice: Optional[Any] = None
    response_format: Optional[ResponseFormat] = None

    def check(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs", "invalid_value")

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        """Messages as plain dicts for the chat template (text parts joined; ``developer`` → system)."""
        out = []
        for m in self.messages:
            content = "".join(p.text for p in m.content) if isinstance(m.content, list) else (m.content or "")
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out


class CompletionRequest(_SamplingFields):
    prompt: Union[PromptText, TokenIds, Annotated[list[PromptText], Field(min_length=1)], Annotated[list[TokenIds], Field(min_length=1)]]
    logprobs: Optional[TopLogprobs] = None  # number of top logprobs per token (0 = only the chosen token)
    echo: Annotated[(StrictBool, *only("echo", False))] = False
    suffix: Annotated[(Optional[Text], *only("suffix", "", None))] = None
    best_of: Annotated[(Optional[Int], *only("best_of", 1, None))] = None

    def check(self) -> None:
        pass

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

    model_config = ConfigDict(extra="forbid", **STRICT)
    max_new_tokens: Optional[MaxTokens] = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: Union[Text, list[Text], None] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: StrictBool = False
    seed: Optional[Seed] = None
    sampling_seed: Optional[Seed] = None
    n: Choices = 1
    skip_special_tokens: Annotated[(StrictBool, *only("skip_special_tokens", True))] = True


class GenerateRequest(_Base):
    """Exactly one of ``text`` and ``input_ids``."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})
    text: Union[PromptText, Annotated[list[PromptText], Field(min_length=1)]] = None
    input_ids: Union[TokenIds, Annotated[list[TokenIds], Field(min_length=1)]] = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: TopLogprobs = 0
    rid: Optional[Annotated[Text, Field(min_length=1)]] = None

    def prompt_list(self) -> tuple[list[tuple[str, Any]], bool]:
        """((kind, value) per prompt, is_batch)."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "exactly one of 'text' and 'input_ids' must be given", "text", "invalid_value")
        if self.text is not None:
            if isinstance(self.text, str):
                return [("text", self.text)], False
            return [("text", t) for t in self.text], True
        ids = self.input_ids
        if all(isinstance(x, list) for x in ids):
            return [("ids", list(x)) for x in ids], True
        return [("ids", list(ids))], False
