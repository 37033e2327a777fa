"""Per-app server state shared by the endpoint modules."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from ..engine import Engine
from .async_engine import AsyncEngine, RequestGroup
from .errors import APIError, to_api_error
from .logprobs import TokenTexts
from .metrics import ServerMetrics
from .submission import DEFAULT_MAX_TOKENS, Submission

# Tokenization and chat templates run here: off the engine thread (a long prompt must not stall
# running streams) and off the event loop. One thread, so the tokenizer never encodes concurrently.
TOKENIZER_THREAD = ThreadPoolExecutor(1, thread_name_prefix="specfw-tokenizer")

# Besides engine.model_name, requests may name the model "default" (SGLang's name) or omit it.
MODEL_ALIASES = ("", "default")


@dataclass
class ServerState:
    bridge: AsyncEngine
    metrics: ServerMetrics
    api_key: str | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.texts = TokenTexts(self.engine.tokenizer)

    @property
    def engine(self) -> Engine:
        return self.bridge.engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def check_model(self, name: str | None) -> None:
        if name is None or name in MODEL_ALIASES or name == self.model_name:
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.", "model", "model_not_found")

    def new_group(self, endpoint: str) -> RequestGroup:
        """A request group whose finishes and token timings feed the metrics."""
        last: dict[int, float] = {}
        t0 = time.monotonic()

        def on_output(index, out):
            now = time.monotonic()
            k = len(out.new_token_ids)
            if index in last and k:
                self.metrics.on_tokens(now - last[index], k)
            if k:
                last[index] = now

        def on_finish(index, reason, out):
            self.metrics.on_finish(endpoint, reason, time.monotonic() - t0)

        return RequestGroup(self.bridge, on_output, on_finish)

    async def submit(self, sub: Submission, endpoint: str) -> RequestGroup:
        """Tokenize on the tokenizer thread, then add the requests on the engine thread."""
        group = self.new_group(endpoint)
        try:
            await asyncio.get_running_loop().run_in_executor(TOKENIZER_THREAD, sub.prepare, self.engine)
            return await self.bridge.submit(sub.build, group)
        except Exception as e:  # noqa: BLE001 - mapped to an OpenAI error
            raise to_api_error(e) from e


def get_state(request: Request) -> ServerState:
    return request.app.state.specfw


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
