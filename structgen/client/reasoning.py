"""Reasoning models: the reasoning a server reports beside the answer, kept next to the parsed value.

A server with a reasoning parser (structgen's or vLLM's `--reasoning-parser`) returns the model's `<think>`
text apart from the answer: as `message.reasoning` (structgen, recent vLLM) or `message.reasoning_content`
(DeepSeek's API, older vLLM), and in a stream as the same names in each `delta`. `content` holds the answer
alone, so `parse` needs no change; `parse_with_reasoning` returns a `Parsed` that also carries the reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
# Both names are read (the first present wins): structgen sends both with the same text, vLLM one by version.
REASONING_KEYS = ("reasoning", "reasoning_content")


@dataclass(slots=True, frozen=True)
class Parsed(Generic[T]):
    """A value and the reasoning the model wrote before it.

    `reasoning`: the reasoning text (markers left out), None when the server reported none (no reasoning
    phase, a server without a reasoning parser, or `include_reasoning: false`). `reasoning_tokens`: the
    response's `usage.completion_tokens_details.reasoning_tokens` (for `n > 1`, all choices together), None
    when the server did not report it. `done`: False for the snapshots `stream_parse_with_reasoning` yields
    while the reply streams (`value` is then a partial value, or `MISSING` before the answer begins)."""

    value: T
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    done: bool = True


def reasoning_text(part: Mapping[str, Any]) -> str | None:
    """The reasoning of a `message` or a stream `delta` (None when it carries none)."""
    for key in REASONING_KEYS:
        value = part.get(key)
        if isinstance(value, str):
            return value
    return None


def reasoning_tokens(data: Any) -> int | None:
    """`usage.completion_tokens_details.reasoning_tokens` of a response or stream chunk, if it has one."""
    usage = data.get("usage") if isinstance(data, dict) else None
    details = usage.get("completion_tokens_details") if isinstance(usage, dict) else None
    count = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return count if isinstance(count, int) else None
