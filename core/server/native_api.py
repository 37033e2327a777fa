"""SGLang-style native endpoints: ``POST /generate``, ``GET /get_model_info``, ``GET /get_server_info``."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..sampling import SamplingParams, SamplingParamsError
from .errors import APIError
from .protocol import GenerateRequest
from .state import ServerState, get_state, new_id
from .streaming import DONE, ClientDisconnected, SSEResponse, sse, until_disconnect
from .submission import Prompt, Submission

router = APIRouter()

GENERATE = "/generate"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


def _params(body: GenerateRequest) -> SamplingParams:
    sp = body.sampling_params
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    seed = sp.sampling_seed if sp.sampling_seed is not None else sp.seed
    try:
        return SamplingParams(
            max_new_tokens=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=seed,
            stop=stop,
            stop_token_ids=list(sp.stop_token_ids or []),
            ignore_eos=sp.ignore_eos,
            repetition_penalty=sp.repetition_penalty,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            logprobs=body.return_logprob,
            top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
        ).validate()
    except SamplingParamsError as e:
        param = "top_logprobs_num" if e.param == "top_logprobs" else f"sampling_params.{e.param}"
        raise APIError(400, str(e), param, "invalid_value") from e


def _finish_reason(st: ServerState, reason: str | None, output_ids: list[int], params: SamplingParams) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason != "stop":
        return {"type": reason}
    last = output_ids[-1] if output_ids else None
    if last is not None and (last in st.engine.eos_token_ids or last in params.stop_token_ids):
        return {"type": "stop", "matched": last}
    if params.stop:
        text = st.texts.tokenizer.decode(output_ids, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in params.stop if s and s in text]
        if hits:
            return {"type": "stop", "matched": min(hits)[1]}
    return {"type": "stop", "matched": last}


def _logprob_triples(st: ServerState, entries) -> tuple[list, list]:
    chosen = [[e.logprob, e.token_id, None] for e in entries]
    tops = [[[lp, t, None] for t, lp in e.top] for e in entries]
    return chosen, tops


class _Acc:
    """Cumulative state of one request of a /generate call."""

    def __init__(self):
        self.text, self.ids, self.logprobs, self.final = "", [], [], None

    def add(self, out):
        self.text += out.text_delta
        self.ids += out.new_token_ids
        self.logprobs += out.logprobs
        self.final = out


def _result(st: ServerState, body: GenerateRequest, params: SamplingParams, rid: str, acc: _Acc, prompt_tokens: int, t0: float) -> dict:
    out = acc.final
    meta = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(acc.ids),
        "finish_reason": _finish_reason(st, out.finish_reason if out and out.finished else None, acc.ids, params),
        "e2e_latency": round(time.monotonic() - t0, 6),
    }
    if out is not None:
        meta.update(out.meta)
    if body.return_logprob:
        meta["output_token_logprobs"], meta["output_top_logprobs"] = _logprob_triples(st, acc.logprobs)
    return {"text": acc.text, "output_ids": list(acc.ids), "meta_info": meta}


@router.post(GENERATE)
async def generate(body: GenerateRequest, raw: Request):
    st = get_state(raw)
    prompts, is_batch = body.prompt_list()
    sp = body.sampling_params
    params = _params(body)
    rid = body.rid or new_id("gen")
    prompt_param = "text" if body.text is not None else "input_ids"
    sub = Submission(
        [Prompt(k, v) for k, v in prompts],
        params,
        n=sp.n,
        max_tokens=sp.max_new_tokens,
        default_max_tokens=DEFAULT_MAX_NEW_TOKENS,
        prompt_param=prompt_param,
        max_tokens_param="sampling_params.max_new_tokens",
        stop_ids_param="sampling_params.stop_token_ids",
        rid_prefix=rid,
    )
    t0 = time.monotonic()
    group = await st.submit(sub, GENERATE)
    n_out = len(group.rids)
    prompt_len = [len(sub.prompt_ids[i // sp.n]) for i in range(n_out)]
    single = not is_batch and n_out == 1

    if body.stream:

        async def events():
            accs = [_Acc() for _ in range(n_out)]
            try:
                async for i, out in group:
                    accs[i].add(out)
                    if out.text_delta or out.finished or out.new_token_ids:
                        res = _result(st, body, params, group.rids[i], accs[i], prompt_len[i], t0)
                        if not single:
                            res["index"] = i
                        yield sse(res)
            except APIError as e:
                yield sse(e.body())
            finally:
                group.abort()
            yield DONE

        return SSEResponse(events(), on_disconnect=group.abort)

    accs = [_Acc() for _ in range(n_out)]

    async def collect():
        async for i, out in group:
            accs[i].add(out)

    try:
        await until_disconnect(raw, collect(), group.abort)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    finally:
        group.abort()
    results = [_result(st, body, params, group.rids[i], accs[i], prompt_len[i], t0) for i in range(n_out)]
    return JSONResponse(results[0] if single else results)


def _config_dict(cfg) -> dict:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            d = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        else:
            d = dataclasses.asdict(cfg)
    except Exception:  # noqa: BLE001 - best effort
        d = {}
    if isinstance(d.get("server"), dict) and d["server"].get("api_key"):
        d["server"]["api_key"] = "***"
    return _jsonable(d)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(getattr(x, "value", x))


@router.get("/get_model_info")
async def get_model_info(raw: Request):
    st = get_state(raw)
    e = st.engine
    spec = getattr(e.cfg, "speculative", None)
    return {
        "model_path": str(e.model_path),
        "tokenizer_path": str(e.model_path),
        "is_generation": True,
        "served_model_name": st.model_name,
        "context_length": e.runner.max_context,
        "dtype": str(e.dtype).replace("torch.", ""),
        "vocab_size": e.runner.vocab_size,
        "speculative_algorithm": getattr(spec, "algorithm", None) if spec is not None else None,
        "worker": type(e.worker).__name__,
    }


@router.get("/get_server_info")
async def get_server_info(raw: Request):
    st = get_state(raw)
    return {
        "config": _config_dict(st.engine.cfg),
        "state": dataclasses.asdict(st.bridge.snapshot),
        "engine_thread_alive": st.bridge.alive,
        "last_engine_error": st.bridge.last_error,
    }
