"""Stored responses (`store: true`, OpenAI's default): what `GET /v1/responses/{id}`, `input_items` and a later
request's `previous_response_id` read.

A bounded in-memory LRU (`--responses-store-size`): the least recently stored or read response is evicted
first, so a server that runs for weeks holds at most that many conversations, and an evicted id answers the
same 404 as one never stored. Nothing survives a restart; every access happens on the event loop, so no lock.

A background response (`background.py`) is stored at once and runs as a task the store tracks: deleting the
response cancels it, and so does `close()` (server shutdown). A running entry is never evicted: its client polls
for it, and cancelling work it is waiting for would be the surprise; how many run at once is bounded by the
admission limits anyway, so the store overshoots its size by at most that many while they run. A response
created with `background` and `stream` keeps its stream's events with it (`replay.py`), bounded apart.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from structgen.server.errors import APIError
from structgen.server.responses.replay import MAX_STORED_LOG_BYTES, EventLog


@dataclass(slots=True, frozen=True, kw_only=True)
class StoredResponse:
    """`response`: the Response object as it was answered; `input_items`: the request's own input items (with
    ids); `context`: every item of the conversation up to and including this response's output, instructions
    excluded (OpenAI does not carry them over), which is what a follow-up request continues from. `streamed`:
    created with `background` and `stream`, whose stream's events `events` keeps (None once they were dropped
    for room, `trim_logs`)."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]
    streamed: bool = False
    events: EventLog | None = None


class ResponseStore:
    def __init__(self, capacity: int, *, log_bytes: int = MAX_STORED_LOG_BYTES) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        self.capacity = capacity
        self.log_bytes = log_bytes  # the most stream events finished responses keep, all together
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # background responses still running

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        key = entry.response["id"]
        self._entries[key] = entry
        self._entries.move_to_end(key)
        if len(self._entries) > self.capacity:
            self._evict(newest=key)

    def _evict(self, *, newest: str) -> None:
        """Drop the least recently used entries over capacity, skipping running ones (see the module doc) and
        the one just stored, which a full store of running responses would otherwise drop at once."""
        over = len(self._entries) - self.capacity
        for old in [key for key in self._entries if key != newest and not self.running(key)][:over]:
            del self._entries[old]

    def replace(self, entry: StoredResponse) -> None:
        """Update a stored response in place (a background one that moved on); one deleted meanwhile stays gone."""
        key = entry.response["id"]
        if key in self._entries:
            self._entries[key] = entry

    def trim_logs(self) -> None:
        """Drop the stream events of finished responses, least recently used first, while all the responses'
        events together take more than `log_bytes`. The responses stay; only streaming them again is refused.
        (Running ones keep theirs, each bounded by `replay.MAX_LOG_BYTES`.)"""
        logs = [(key, entry.events) for key, entry in self._entries.items() if entry.events is not None]
        total = sum(log.size for _, log in logs)
        for key, log in logs:
            if total <= self.log_bytes:
                return
            if log.done:
                total -= log.size
                self._entries[key] = replace(self._entries[key], events=None)

    def peek(self, response_id: str) -> StoredResponse | None:
        """The stored response, if any, without counting it as used."""
        return self._entries.get(response_id)

    def track(self, response_id: str, task: asyncio.Task[None]) -> None:
        """`task` runs the stored background response `response_id` until it finishes."""
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    def running(self, response_id: str) -> bool:
        task = self._tasks.get(response_id)
        return task is not None and not task.done()

    def cancel(self, response_id: str) -> None:
        """Cancel the task of a running background response (which aborts its engine requests); else nothing."""
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Cancel every running background response and wait for the tasks to end."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def get(self, response_id: str, *, param: str | None = None) -> StoredResponse:
        """The stored response, freshly used; a 404 naming `param` when it is unknown, deleted or evicted."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param=param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        if self._entries.pop(response_id, None) is None:
            raise not_found(response_id)
        self.cancel(response_id)  # nothing keeps running for a deleted response


def not_found(response_id: str, *, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(
        404,
        f"{what} with id {response_id!r} not found (never stored, deleted, or evicted from this server's "
        "in-memory store; see --responses-store-size)",
        param=param,
        code="previous_response_not_found" if param == "previous_response_id" else "response_not_found",
    )
