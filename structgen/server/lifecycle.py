"""In-flight generations, admission control and graceful shutdown.

Each generation request holds a `Ticket` from `Lifecycle.open()` until its response (stream included) ends.
`open()` refuses with 503 once draining and with 429 (`Retry-After`) while too many accepted requests still wait
for their first token. `drain(timeout)` stops admitting, gives the in-flight requests `timeout` seconds, then
aborts the rest in the engine: their iterators end early, so a plain request answers 503 and a stream sends a
final error event. `GracefulServer` runs `drain` on SIGTERM between closing the listening socket and uvicorn's own
wait for open connections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn

from structgen.server.errors import APIError

if TYPE_CHECKING:
    from structgen.engine.async_engine import AsyncEngine
    from structgen.server.limits import ServerLimits

logger = logging.getLogger("structgen.server")

_POLL_S = 0.02
# After the abort, how long the aborted requests get to send their error and close.
_ABORT_GRACE_S = 5.0


class Ticket:
    """One HTTP generation request: the engine request ids it started, and whether shutdown aborted them."""

    __slots__ = ("_closed", "_lifecycle", "aborted_by_shutdown", "request_ids")

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._closed = False
        self.request_ids: list[str] = []
        self.aborted_by_shutdown = False

    @contextmanager
    def queued(self, request_id: str) -> Iterator[None]:
        """Count `request_id` as waiting (for admission control) until its first output arrives; then (not when
        it failed to start) run the hook `Lifecycle.on_start` holds for it."""
        self.request_ids.append(request_id)
        self._lifecycle.num_queued += 1
        try:
            yield
        finally:
            self._lifecycle.num_queued -= 1
        hook = self._lifecycle.start_hooks.pop(request_id, None)
        if hook is not None:
            hook()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._lifecycle.tickets.discard(self)


class Lifecycle:
    def __init__(self, engine: AsyncEngine, limits: ServerLimits) -> None:
        self.engine = engine
        self.limits = limits
        self.tickets: set[Ticket] = set()
        self.num_queued = 0
        self.draining = False
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        # Engine request id -> what to call once it has produced its first output (`on_start`).
        self.start_hooks: dict[str, Callable[[], None]] = {}

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await `hook` as draining starts (every drain: a hook must be idempotent). For work no client waits on
        once the server is gone (background responses), which would otherwise hold shutdown for its timeout."""
        self._drain_hooks.append(hook)

    @contextmanager
    def on_start(self, request_id: str, hook: Callable[[], None]) -> Iterator[None]:
        """Within this block, call `hook` once the engine request `request_id` has produced its first output: it
        left the engine's queue and runs. For work no client waits on (a background response), which reports
        when it stops being `queued`; a plain answer (`stream=False`) sends nothing else until it finishes."""
        self.start_hooks[request_id] = hook
        try:
            yield
        finally:
            self.start_hooks.pop(request_id, None)

    def open(self) -> Ticket:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.num_queued >= self.limits.max_waiting_requests:
            raise APIError(
                429,
                f"the server is busy: {self.num_queued} requests are waiting (limit "
                f"{self.limits.max_waiting_requests}); retry later",
                code="too_many_requests",
                headers={"Retry-After": str(self.limits.retry_after_s)},
            )
        ticket = Ticket(self)
        self.tickets.add(ticket)
        return ticket

    async def drain(self, timeout: float | None = None) -> int:
        """Stop admitting, wait up to `timeout` seconds (default: the configured shutdown timeout) for the
        in-flight requests, then abort the rest. Returns how many requests were aborted."""
        self.draining = True
        for hook in self._drain_hooks:
            await hook()
        timeout = self.limits.shutdown_timeout_s if timeout is None else timeout
        if self.tickets:
            logger.info("draining %d in-flight request(s), up to %.1f s", len(self.tickets), timeout)
        await self._wait_empty(timeout)
        left = list(self.tickets)
        for ticket in left:
            ticket.aborted_by_shutdown = True
            for request_id in ticket.request_ids:
                await self.engine.abort(request_id)
        if left:
            logger.warning("shutdown timeout: aborted %d in-flight request(s)", len(left))
            await self._wait_empty(_ABORT_GRACE_S)
        return len(left)

    async def _wait_empty(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.tickets and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)


class GracefulServer(uvicorn.Server):
    """uvicorn, but SIGTERM drains `lifecycle` after the listening sockets close and before connections are
    waited for (uvicorn alone would wait for every open stream without end, or cut it off without a word)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a handled SIGTERM/SIGINT once it has shut down, which kills the process before the
        # caller's cleanup runs (engine shutdown, tensor-parallel workers). A drained server exits normally.
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await self.lifecycle.drain()
        await super().shutdown(sockets)
