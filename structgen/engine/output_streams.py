"""The queue that carries one request's outputs from the engine's step thread to the event loop of the server
(`AsyncEngine.generate`'s iterator), and the delivery of a step's outputs in one call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structgen.engine.outputs import RequestOutput


class OutputStream:
    """One request's queue of outputs, filled from the step thread, drained on the event loop. Without
    `every_step`, only the first output (the request runs) and the finished one are passed on."""

    __slots__ = ("every_step", "loop", "queue", "started")

    def __init__(self, loop: asyncio.AbstractEventLoop, *, every_step: bool = True) -> None:
        self.loop = loop
        self.every_step = every_step
        self.started = False
        self.queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

    def wants(self, output: RequestOutput) -> bool:
        if output.finished or self.every_step or not self.started:
            self.started = True
            return True
        return False

    def put(self, item: RequestOutput | BaseException | None) -> bool:
        """Queue `item` for the event loop; False when that loop is closed (`call_on_loop`)."""
        return call_on_loop(self.loop, self.queue.put_nowait, item)


def call_on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> bool:
    """`loop.call_soon_threadsafe(callback, *args)` from the step thread; False when the loop is closed. A loop can
    close while a request of its own still runs (an `asyncio.run` that returns without awaiting its stream's end:
    the abort its cancellation posted has not run yet). Nobody is left to read that request: the step thread must
    go on serving the others rather than die on the RuntimeError."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
        return False
    return True


def deliver(items: list[tuple[OutputStream, RequestOutput]]) -> None:
    """On the event loop: a step's outputs into their streams, in the step's order."""
    for stream, output in items:
        stream.queue.put_nowait(output)
