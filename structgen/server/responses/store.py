"""Stored responses (`store: true`, OpenAI's default): what `GET /v1/responses/{id}`, `input_items` and a later
request's `previous_response_id` read.

A bounded in-memory LRU (`--responses-store-size`): the least recently stored or read response is evicted
first, so a server that runs for weeks holds at most that many conversations, and an evicted id answers the
same 404 as one never stored. Nothing survives a restart; every access happens on the event loop, so no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from structgen.server.errors import APIError


@dataclass(slots=True, frozen=True, kw_only=True)
class StoredResponse:
    """`response`: the Response object as it was answered; `input_items`: the request's own input items (with
    ids); `context`: every item of the conversation up to and including this response's output, instructions
    excluded (OpenAI does not carry them over), which is what a follow-up request continues from."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        key = entry.response["id"]
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

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


def not_found(response_id: str, *, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(
        404,
        f"{what} with id {response_id!r} not found (never stored, deleted, or evicted from this server's "
        "in-memory store; see --responses-store-size)",
        param=param,
        code="previous_response_not_found" if param == "previous_response_id" else "response_not_found",
    )
