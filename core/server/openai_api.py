"""``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..sampling import SamplingParamsError
from .errors import APIError
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import ServerState, get_state, new_id
from .streaming import DONE, ClientDisconnected, SSEResponse, sse, until_disconnect
from .submission import Prompt, Submission

router = APIRouter()

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's field: prompt tokens served from the prefix cache
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _cached_tokens(sub: Submission, finals: list) -> int | None:
    """Prompt tokens taken from the prefix cache, each prompt counted once (as ``prompt_tokens``):
    the most any of its ``n`` choices took (choice i runs prompt i // n). None without a cache."""
    got = [(o.meta or {}).get("cached_tokens") if o is not None else None for o in finals]
    if all(c is None for c in got):
        return None
    per_prompt = [max((c or 0) for c in got[i * sub.n : (i + 1) * sub.n]) for i in range(len(sub.prompt_ids))]
    return sum(per_prompt)


def _prompt_tokens(sub: Submission) -> int:
    return sum(len(ids) for ids in sub.prompt_ids)


def _disconnected() -> Response:
    return Response(status_code=499)  # nobody reads it; keeps the access log honest


# ---- chat ------------------------------------------------------------------------------------
@router.post(CHAT)
async def chat_completions(body: ChatCompletionRequest, raw: Request):
    st = get_state(raw)
    st.check_model(body.model)
    body.check()
    top_n = body.top_logprobs or 0
    params = body.sampling_params(logprobs=body.logprobs, top_logprobs=top_n)
    rid = new_id("chatcmpl")
    sub = Submission(
        [Prompt("chat", body.chat_messages())],
        params,
        n=body.n,
        max_tokens=body.effective_max_tokens,
        default_max_tokens=st.default_max_tokens,
        prompt_param="messages",
        max_tokens_param=body.max_tokens_param,
        rid_prefix=rid,
    )
    group = await st.submit(sub, CHAT)
    created = int(time.time())
    if body.stream:
        return SSEResponse(_chat_stream(st, body, sub, group, rid, created, top_n), on_disconnect=group.abort)
    outs = await _collect(raw, group)
    if outs is None:
        return _disconnected()
    choices, completion_tokens = [], 0
    for i in range(len(group.rids)):
        seq = outs[i]
        final = seq[-1]
        completion_tokens += final.completion_tokens
        lp = None
        if body.logprobs:
            lp = {"content": chat_logprobs([e for o in seq for e in o.logprobs], st.texts, top_n), "refusal": None}
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(o.text_delta for o in seq), "refusal": None},
                "logprobs": lp,
                "finish_reason": final.finish_reason,
            }
        )
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": st.model_name,
            "choices": choices,
            "usage": _usage(_prompt_tokens(sub), completion_tokens, _cached_tokens(sub, [outs[i][-1] for i in range(len(group.rids))])),
            "system_fingerprint": None,
        }
    )


async def _chat_stream(st: ServerState, body: ChatCompletionRequest, sub: Submission, group, rid: str, created: int, top_n: int):
    usage_extra = {"usage": None} if body.include_usage else {}

    def chunk(index, delta, finish_reason=None, logprobs=None):
        return sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": st.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
                **usage_extra,
            }
        )

    completion_tokens, finals = [0] * len(group.rids), [None] * len(group.rids)
    try:
        for i in range(len(group.rids)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, out in group:
            completion_tokens[i], finals[i] = out.completion_tokens, out
            lp = None
            if body.logprobs and out.logprobs:
                lp = {"content": chat_logprobs(out.logprobs, st.texts, top_n), "refusal": None}
            if out.text_delta or lp:
                yield chunk(i, {"content": out.text_delta}, None, lp)
            if out.finished:
                yield chunk(i, {}, out.finish_reason)
        if body.include_usage:
            yield sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": st.model_name,
                    "choices": [],
                    "usage": _usage(_prompt_tokens(sub), sum(completion_tokens), _cached_tokens(sub, finals)),
                }
            )
    except APIError as e:
        yield sse(e.body())
    finally:
        group.abort()
    yield DONE


# ---- completions -----------------------------------------------------------------------------
@router.post(COMPLETIONS)
async def completions(body: CompletionRequest, raw: Request):
    st = get_state(raw)
    st.check_model(body.model)
    top_n = body.logprobs or 0
    try:
        params = body.sampling_params(logprobs=body.logprobs is not None, top_logprobs=top_n)
    except SamplingParamsError as e:
        if e.param == "top_logprobs":
            raise APIError(400, f"logprobs must be in [0, 20], got {top_n}", "logprobs", "invalid_value") from e
        raise
    rid = new_id("cmpl")
    sub = Submission(
        [Prompt(kind, value) for kind, value in body.prompt_list()],
        params,
        n=body.n,
        max_tokens=body.max_tokens,
        default_max_tokens=st.default_max_tokens,
        prompt_param="prompt",
        max_tokens_param="max_tokens",
        rid_prefix=rid,
    )
    group = await st.submit(sub, COMPLETIONS)
    created = int(time.time())
    want_lp = body.logprobs is not None
    if body.stream:
        return SSEResponse(_completion_stream(st, body, sub, group, rid, created, top_n), on_disconnect=group.abort)
    outs = await _collect(raw, group)
    if outs is None:
        return _disconnected()
    choices, completion_tokens = [], 0
    for i in range(len(group.rids)):
        seq = outs[i]
        final = seq[-1]
        completion_tokens += final.completion_tokens
        lp = completion_logprobs([e for o in seq for e in o.logprobs], st.texts, top_n) if want_lp else None
        choices.append({"index": i, "text": "".join(o.text_delta for o in seq), "logprobs": lp, "finish_reason": final.finish_reason})
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": st.model_name,
            "choices": choices,
            "usage": _usage(_prompt_tokens(sub), completion_tokens, _cached_tokens(sub, [outs[i][-1] for i in range(len(group.rids))])),
            "system_fingerprint": None,
        }
    )


async def _completion_stream(st: ServerState, body: CompletionRequest, sub: Submission, group, rid: str, created: int, top_n: int):
    usage_extra = {"usage": None} if body.include_usage else {}
    want_lp = body.logprobs is not None

    def chunk(index, text, finish_reason=None, logprobs=None):
        return sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": st.model_name,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
                **usage_extra,
            }
        )

    n = len(group.rids)
    completion_tokens, offsets, finals = [0] * n, [0] * n, [None] * n
    try:
        async for i, out in group:
            completion_tokens[i], finals[i] = out.completion_tokens, out
            lp = None
            if want_lp and out.logprobs:
                lp = completion_logprobs(out.logprobs, st.texts, top_n, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if out.text_delta or lp:
                yield chunk(i, out.text_delta, None, lp)
            if out.finished:
                yield chunk(i, "", out.finish_reason)
        if body.include_usage:
            yield sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": st.model_name,
                    "choices": [],
                    "usage": _usage(_prompt_tokens(sub), sum(completion_tokens), _cached_tokens(sub, finals)),
                }
            )
    except APIError as e:
        yield sse(e.body())
    finally:
        group.abort()
    yield DONE


# ---- models ----------------------------------------------------------------------------------
def _model_card(st: ServerState) -> dict:
    return {
        "id": st.model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "specfw",
        "root": str(st.engine.model_path),
        "max_model_len": st.engine.runner.max_context,
    }


@router.get("/v1/models")
async def list_models(raw: Request):
    return {"object": "list", "data": [_model_card(get_state(raw))]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, raw: Request):
    st = get_state(raw)
    st.check_model(model)
    return _model_card(st)


async def _collect(raw, group):
    """Every choice's outputs, or None when the client went away (its requests are aborted)."""
    try:
        return await until_disconnect(raw, group.collect(), group.abort)
    except ClientDisconnected:
        return None
    finally:
        group.abort()
