"""Response shapes, published in the OpenAPI schema (the handlers build plain dicts; these say
what those dicts hold). Extra keys are allowed: clients must ignore fields they do not know."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {...}}`` (OpenAI's layout)."""

    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None  # absent with engine.disable_radix_cache


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str
    refusal: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[dict[str, Any]]
    finish_reason: Optional[str]


class ChatCompletion(BaseModel):
    """``stream: false``; with ``stream: true`` the body is ``text/event-stream`` of
    ``chat.completion.chunk`` objects, ending with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]]
    finish_reason: Optional[str]


class Completion(BaseModel):
    """``stream: false``; with ``stream: true`` the body is ``text/event-stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class GenerateResult(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: Optional[int] = None


GenerateResponse = Union[GenerateResult, list[GenerateResult]]


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    is_generation: bool
    served_model_name: str
    context_length: int
    dtype: str
    vocab_size: int
    speculative_algorithm: Optional[str]
    worker: str


class ServerInfo(BaseModel):
    config: dict[str, Any]
    state: dict[str, Any]
    engine_thread_alive: bool
    last_engine_error: Optional[str]


class Health(BaseModel):
    status: Literal["ok"]
