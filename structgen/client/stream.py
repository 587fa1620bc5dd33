"""Decoding one choice of an SSE chat completions stream into partial values and the final value."""

from __future__ import annotations

import copy
from typing import Any

from structgen.client.core import decode_output
from structgen.client.errors import APIConnectionError, stream_error
from structgen.client.partial import MISSING, parse_partial
from structgen.client.reasoning import Parsed, reasoning_text, reasoning_tokens
from structgen.client.retry import decode_json
from structgen.client.targets import Target


class StreamDecoder:
    """Reads one choice's SSE lines (`data: {...}`), collecting its text (and any reasoning beside it); `feed`
    returns the new partial value when the line changed it, `result` the final validated value."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.parts: list[str] = []
        self.reasoning: str | None = None  # None until a delta carries reasoning
        self.reasoning_tokens: int | None = None
        self.finish_reason: str | None = None
        self._last: Any = MISSING
        self._broken = False  # the prefix is no JSON: no more partials (the final value will say why)

    def feed(self, line: str) -> Any:
        content_changed, _ = self._read(line)
        return self._partial() if content_changed else MISSING

    def _read(self, line: str) -> tuple[bool, bool]:
        """Takes in one SSE line: (whether the answer text grew, whether the reasoning did)."""
        if not line.startswith("data:"):
            return False, False  # blank separators, comments, `event:` / `id:` fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            return False, False
        event = decode_json(payload)
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            raise stream_error(event)
        # The usage chunk (with `stream_options.include_usage`) reports the reasoning tokens.
        if (tokens := reasoning_tokens(event)) is not None:
            self.reasoning_tokens = tokens
        content_changed = reasoning_changed = False
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if text := delta.get("content"):
                self.parts.append(text)
                content_changed = True
            if (thought := reasoning_text(delta)) is not None:
                self.reasoning = (self.reasoning or "") + thought
                reasoning_changed = reasoning_changed or bool(thought)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return content_changed, reasoning_changed

    def _partial(self) -> Any:
        if self._broken:
            return MISSING
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
        return decode_output(self.target, "".join(self.parts), self.finish_reason, reasoning=self.reasoning)


class ReasoningStreamDecoder(StreamDecoder):
    """`feed` returns a `Parsed` snapshot (`done=False`: the reasoning so far and the partial value so far)
    whenever either grew; `result` the final `Parsed`."""

    def feed(self, line: str) -> Any:
        content_changed, reasoning_changed = self._read(line)
        partial = self._partial() if content_changed else MISSING
        if partial is MISSING:
            if not reasoning_changed:
                return MISSING
            # Only the reasoning grew: the same value again, as a copy the caller may change.
            partial = copy.deepcopy(self._last)
        return Parsed(partial, self.reasoning, self.reasoning_tokens, done=False)

    def result(self) -> Any:
        return Parsed(super().result(), self.reasoning, self.reasoning_tokens)
