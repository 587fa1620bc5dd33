"""The FastAPI app: OpenAI's `/v1/models`, `/v1/chat/completions`, `/v1/completions` and `/v1/responses` over an
`AsyncEngine`, plus `/health`, `/metrics`, vLLM's `/tokenize` / `/detokenize` and its runtime LoRA routes
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

The routes live in `routes_models.py` / `routes_chat.py` / `routes_completions.py` / `routes_tokenize.py` /
`responses/`, the engine plumbing in `generation.py`, SSE in `streaming.py`; this module wires them with auth,
limits, metrics and the lifecycle (`app.state.server`).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from structgen import __version__
from structgen.engine.async_engine import AsyncEngine
from structgen.server.context import ServerContext
from structgen.server.errors import APIError, error_body, install_error_handlers
from structgen.server.lifecycle import Lifecycle
from structgen.server.limits import BodySizeLimit, ServerLimits
from structgen.server.metrics import CONTENT_TYPE, ServerMetrics
from structgen.server.middleware import RequestLog
from structgen.server.openapi import add_openapi_route
from structgen.server.responses import add_responses_routes
from structgen.server.routes_chat import add_chat_route
from structgen.server.routes_completions import add_completions_route
from structgen.server.routes_models import add_model_routes
from structgen.server.routes_tokenize import add_tokenize_routes


def build_app(
    engine: AsyncEngine,
    tokenizer: Any,
    *,
    model_name: str,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under `model_name`. With `api_key`, every route but `/health`
    (`/metrics` and `/openapi.json` included) needs `Authorization: Bearer <api_key>`. `app.state.server` is the
    `ServerContext` (its `lifecycle.drain(timeout)` finishes or aborts in-flight requests; the lifespan runs it
    on shutdown)."""
    limits = limits or ServerLimits()
    lifecycle = Lifecycle(engine, limits)
    metrics = ServerMetrics(
        engine, in_flight=lambda: len(lifecycle.tickets), queued=lambda: lifecycle.num_queued
    )
    ctx = ServerContext(
        engine=engine,
        tokenizer=tokenizer,
        model_name=model_name,
        limits=limits,
        metrics=metrics,
        lifecycle=lifecycle,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await lifecycle.drain()  # a no-op after GracefulServer's drain on SIGTERM

    # The OpenAPI document is served by `add_openapi_route`, behind the key (FastAPI's own route is open).
    app = FastAPI(
        title="structgen",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.server = ctx
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    app.add_middleware(RequestLog, metrics=metrics)  # outermost: a 413 is logged and counted too
    auth = Depends(_auth(api_key))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[auth], response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    router = APIRouter(prefix="/v1", dependencies=[auth])
    add_model_routes(router, ctx)
    add_chat_route(router, ctx)
    add_completions_route(router, ctx)
    add_responses_routes(router, ctx)
    app.include_router(router)
    # vLLM's /tokenize and /detokenize sit at the root, not under /v1: clients written for vLLM call them there.
    root = APIRouter(dependencies=[auth])
    add_tokenize_routes(root, ctx)
    app.include_router(root)
    add_openapi_route(app, dependencies=[auth])
    return app


def _auth(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode() if api_key else None

    # A coroutine, not a plain function: FastAPI runs a plain dependency in its thread pool, a thread handoff
    # (and, under load, new threads) for every request, all for a header comparison.
    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: no key prefix leaks through timing
            raise APIError(
                401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )

    return check
