"""Pure ASGI middleware: one log line and one `structgen_http_requests_total` count per HTTP request, written
when the response (stream included) ends."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structgen.server.metrics import ServerMetrics

logger = logging.getLogger("structgen.server")


class RequestLog:
    def __init__(self, app: Any, *, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        state = scope.setdefault("state", {})

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # The matched route's template, not the raw path: unknown paths must not grow the label set.
            route = scope.get("route")
            label = getattr(route, "path", None) or "other"
            self.metrics.http_requests.labels(label, scope["method"], str(status)).inc()
            usage = state.get("usage")
            tokens = f" prompt_tokens={usage[0]} completion_tokens={usage[1]}" if usage else ""
            logger.info(
                "%s %s %s %d%s %.1f ms",
                state.get("request_id", "-"),
                scope["method"],
                scope["path"],
                status,
                tokens,
                (time.perf_counter() - start) * 1000,
            )
