"""Decoding one choice of an SSE chat completions stream into partial values and the final value."""

from __future__ import annotations

import copy
from typing import Any

from structgen.client.core import decode_output
from structgen.client.errors import APIConnectionError, stream_error
from structgen.client.partial import MISSING, parse_partial
from structgen.client.retry import decode_json
from structgen.client.targets import Target


class StreamDecoder:
    """Reads one choice's SSE lines (`data: {...}`), collecting its text; `feed` returns the new partial value
    when the line changed it, `result` the final validated value."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self._last: Any = MISSING
        self._broken = False  # the prefix is no JSON: no more partials (the final value will say why)

    def feed(self, line: str) -> Any:
        if not line.startswith("data:"):
            return MISSING  # blank separators, comments, `event:` / `id:` fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            return MISSING
        event = decode_json(payload)
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            raise stream_error(event)
        changed = False
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                self.parts.append(delta)
                changed = True
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return self._partial() if changed and not self._broken else MISSING

    def _partial(self) -> Any:
        try:
            value = self.target.unwrap(parse_partial("".join(self.parts)))
        except ValueError:
            self._broken = True
            return MISSING
        if value is MISSING or value == self._last:
            return MISSING
        self._last = copy.deepcopy(value)  # the caller may change what it is given
        return value

    def result(self) -> Any:
        if self.finish_reason is None:
            raise APIConnectionError("the stream ended before the output finished")
        return decode_output(self.target, "".join(self.parts), self.finish_reason)
