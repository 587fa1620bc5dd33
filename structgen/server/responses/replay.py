"""Resumable streams: the events of a response created with `background` and `stream`, kept so that any number
of readers can stream them, from the start or after the last sequence number they saw, and then live.

OpenAI's resumable background streams: the POST streams the events as a plain streamed request would, but
the response runs on when its client goes away, and `GET /v1/responses/{id}?stream=true&starting_after=N`
replays the events after N, then follows the live ones until the response ends (`response.completed`,
`.incomplete`, `.failed` or `.cancelled`). Each event is kept as the SSE frame it goes out as (encoded once,
for every reader).

Memory is bounded twice. A response keeps at most `MAX_LOG_BYTES` of frames, dropping its oldest quarter when
it would hold more: a reader that asks for a dropped event gets a 400, and one that falls that far behind the
live events sees its stream end (and can resume from the last event it got, as long as that is kept). The
store keeps the frames of finished responses up to `MAX_STORED_LOG_BYTES` together, the least recently used
dropped first (`ResponseStore.trim_logs`). The frames of a response go when the response does (deleted or
evicted), though a reader in the middle of them keeps them until it is done.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from structgen.server.errors import APIError

# A response's own frames (a text delta is ~200 bytes: some 40,000 of them; with 20 top logprobs each, ~3,000).
MAX_LOG_BYTES = 8 << 20
# The frames of finished responses, all together; beyond it the least recently used lose theirs.
MAX_STORED_LOG_BYTES = 256 << 20
# The events after which a response's stream is over.
FINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True, eq=False)
class EventLog:
    """The events of one response in sequence-number order, as SSE frames; `done` once its final event is in."""

    max_bytes: int = MAX_LOG_BYTES
    size: int = 0  # bytes held
    done: bool = False
    _frames: list[bytes] = field(default_factory=list)  # a list: readers index it (a deque's middle is slow)
    _first: int = 0  # the sequence number of `_frames[0]`
    # Set (and replaced) on every change: what waiting readers wake on.
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def next_number(self) -> int:
        """The sequence number the next event takes."""
        return self._first + len(self._frames)

    @property
    def first_kept(self) -> int:
        return self._first

    def append(self, event: dict[str, Any]) -> None:
        if self.done:
            raise RuntimeError(f"the stream is over; got a {event['type']} event after its end")
        # The events' own numbers are what readers resume by: they must be the log's.
        if event["sequence_number"] != self.next_number:
            raise RuntimeError(f"event {event['sequence_number']} appended as number {self.next_number}")
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        frame = f"event: {event['type']}\ndata: {data}\n\n".encode()
        self._frames.append(frame)
        self.size += len(frame)
        if self.size > self.max_bytes:
            # The oldest quarter at once: a list's front is dear to drop, so not for every event.
            drop = 0
            while self.size > self.max_bytes * 3 // 4 and drop < len(self._frames) - 1:
                self.size -= len(self._frames[drop])
                drop += 1
            del self._frames[:drop]
            self._first += drop
        self.done = event["type"] in FINAL_EVENTS
        self._wake()

    def end(self, kind: str, response: dict[str, Any]) -> None:
        """Append the final event `kind` (`response.failed` / `.cancelled`) unless the stream is over already."""
        assert kind in FINAL_EVENTS, kind  # any other would leave the readers waiting
        if not self.done:
            self.append({"type": kind, "sequence_number": self.next_number, "response": response})

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[bytes]:
        """The frames after sequence number `after` (-1: all), then the new ones as they come, until the final
        event. A reader that falls behind the oldest kept frame stops there (its client resumes, or learns why
        not, from a GET)."""
        number = after + 1
        while True:
            if number < self._first:
                return
            if number < self.next_number:
                yield self._frames[number - self._first]
                number += 1
            elif self.done:
                return
            else:
                await self._changed.wait()


def cursor(log: EventLog, starting_after: str | None) -> int:
    """The sequence number a reader resumes after (-1 for the whole stream); 400 for one that names no event
    sent so far, or an event no longer kept."""
    if starting_after is None:
        after = -1
    else:
        try:
            after = int(starting_after)
        except ValueError:
            after = -2
        if after < 0:
            raise APIError(
                400,
                f"starting_after must be a sequence number (an integer >= 0), got {starting_after!r}",
                param="starting_after",
                code="invalid_value",
            )
    last = log.next_number - 1
    if after > last:
        raise APIError(
            400,
            f"starting_after={after} is past the last event of this response so far (sequence number {last})",
            param="starting_after",
            code="invalid_value",
        )
    if after + 1 < log.first_kept:
        raise APIError(
            400,
            f"the events of this response before sequence number {log.first_kept} are no longer kept (the "
            f"server keeps the last {MAX_LOG_BYTES >> 20} MiB of a response's events): resume with "
            f"starting_after >= {log.first_kept - 1}, or GET the response without stream",
            param="starting_after",
            code="invalid_value",
        )
    return after


def event_stream(log: EventLog, after: int) -> StreamingResponse:
    """The SSE response of `log`'s events after `after`, then its live ones. Its client leaving ends only this
    reader: the response runs on."""
    return StreamingResponse(log.follow(after), media_type="text/event-stream", headers=_SSE_HEADERS)
