"""The conversion layer, answer side: chat outputs → Responses output items and Response objects.

`OutputItems` builds a response's items from its chat deltas (reasoning, text, tool-call starts, argument pieces)
and says, step by step, which stream events each change makes. A plain answer runs through it too
(`from_choice`), so a stream and a plain answer of the same output end with the same items.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Literal

from structgen.server import answers as a
from structgen.server.generation import Started
from structgen.server.responses.convert import echo_tools
from structgen.server.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    Response,
    ResponsesRequest,
    ResponseUsage,
    new_id,
)

Status = Literal["completed", "incomplete"]
Event = dict[str, Any]  # a stream event without its sequence number


class OutputItems:
    """The output items of one response. An item is open while it is written (`status: in_progress`) and is
    closed when the next one starts or the output ends. Whitespace before the first item is held back: a model
    that writes a newline before its tool calls made calls only, as chat's `content: null` says."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._pending = ""
        self._pending_logprobs: list[dict[str, Any]] = []

    def reasoning(self, delta: str) -> list[Event]:
        """Reasoning text: one `reasoning` item (OpenAI's `ResponseReasoningItem`, its text in one
        `reasoning_text` content part), opened by the first piece; it comes before the answer's items."""
        events: list[Event] = []
        if self._open is None or self._open["type"] != "reasoning":
            if self._open is not None:
                events += self._close("completed")
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "encrypted_content": None,
                "status": "in_progress",
            }
            events += self._add(item)
            part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            events.append(self._on_text("response.content_part.added", part=copy.deepcopy(part)))
        self._open["content"][0]["text"] += delta  # type: ignore[index]
        events.append(self._on_text("response.reasoning_text.delta", delta=delta))
        return events

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != "message":
            if self._open is not None:
                events += self._close("completed")
            self._pending += delta
            self._pending_logprobs += logprobs or []
            if not self._pending.strip():
                return events
            delta, logprobs = self._pending, self._pending_logprobs
            self._pending, self._pending_logprobs = "", []
            events += self._open_message()
        part = self._open["content"][0]  # type: ignore[index]
        part["text"] += delta
        part["logprobs"] += logprobs or []
        events.append(self._on_text("response.output_text.delta", delta=delta, logprobs=list(logprobs or [])))
        return events

    def call(self, call_id: str, name: str) -> list[Event]:
        """A function call starts (what came before it is closed; held-back whitespace is dropped)."""
        events = self._close("completed") if self._open is not None else []
        self._pending, self._pending_logprobs = "", []
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": call_id,
            "name": name,
        }
        return [*events, *self._add(item)]

    def arguments(self, delta: str) -> list[Event]:
        item = self._open
        assert item is not None and item["type"] == "function_call", "arguments before their call"
        item["arguments"] += delta
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "delta": delta,
            }
        ]

    def finish(self, status: Status) -> list[Event]:
        """Close the output. One that wrote nothing (or only whitespace) besides its reasoning is a message with
        that text, as chat answers `content: ""`."""
        events: list[Event] = []
        if all(item["type"] == "reasoning" for item in self.items):
            if self._open is not None:  # the output ended in its reasoning (or right after it)
                events += self._close(status)
            pending, logprobs = self._pending, self._pending_logprobs
            self._pending, self._pending_logprobs = "", []
            events += self._open_message()
            if pending:
                events += self.text(pending, logprobs)
        if self._open is not None:
            events += self._close(status)
        return events

    def _open_message(self) -> list[Event]:
        item = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        events = self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return [*events, self._on_text("response.content_part.added", part=copy.deepcopy(part))]

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self._open = item
        return [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": copy.deepcopy(item),
            }
        ]

    def _close(self, status: Status) -> list[Event]:
        item, self._open = self._open, None
        assert item is not None
        item["status"] = status
        index = len(self.items) - 1
        if item["type"] == "reasoning":
            part = item["content"][0]
            events = [
                self._on_text("response.reasoning_text.done", text=part["text"], item=item),
                self._on_text("response.content_part.done", part=copy.deepcopy(part), item=item),
            ]
        elif item["type"] == "message":
            part = item["content"][0]
            events = [
                self._on_text(
                    "response.output_text.done", text=part["text"], logprobs=list(part["logprobs"]), item=item
                ),
                self._on_text("response.content_part.done", part=copy.deepcopy(part), item=item),
            ]
        else:
            done = {
                "item_id": item["id"],
                "output_index": index,
                "name": item["name"],
                "arguments": item["arguments"],
            }
            events = [{"type": "response.function_call_arguments.done", **done}]
        return [
            *events,
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)},
        ]

    def _on_text(self, kind: str, *, item: dict[str, Any] | None = None, **fields: Any) -> Event:
        """An event about the open item's text part (a message's, or a reasoning item's)."""
        item = item if item is not None else self._open
        assert item is not None
        return {
            "type": kind,
            "item_id": item["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            **fields,
        }


def status_of(finish_reason: str | None) -> Status:
    """A chat finish reason as a Response status: cut by the output budget is `incomplete`."""
    return "incomplete" if finish_reason == "length" else "completed"


def from_choice(choice: a.ChatChoice, *, reasoning_tokens: int = 0) -> tuple[list[dict[str, Any]], Status]:
    """The output items of a finished chat choice (through `OutputItems`, as a stream would build them).
    `reasoning_tokens`: the output tokens before the answer, whose logprobs belong to no text part."""
    message, status = choice.message, status_of(choice.finish_reason)
    output = OutputItems()
    # The logprobs cover the whole output; with calls in it they belong to no text part.
    logprobs = (choice.logprobs or {}).get("content") if not message.tool_calls else None
    logprobs = logprobs[reasoning_tokens:] if logprobs is not None else None
    # Only what a stream would send: no reasoning item for an empty reasoning, and an empty answer, sent as no
    # delta at all, leaves the reasoning open for `finish` to close with the output's status.
    if message.reasoning:
        output.reasoning(message.reasoning)
    if message.content or logprobs:
        output.text(message.content, logprobs)
    for call in message.tool_calls or ():
        output.call(call["id"], call["function"]["name"])
        output.arguments(call["function"]["arguments"])
    output.finish(status)
    return output.items, status


def response_head(body: ResponsesRequest, *, response_id: str, model: str) -> dict[str, Any]:
    """The fields a Response echoes from its request (OpenAI's defaults where it gave none)."""
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": response_id,
        "created_at": int(time.time()),
        "model": model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": text_format or {"type": "text"}},
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": echo_tools(body.tools),
        "top_logprobs": body.top_logprobs,
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "metadata": body.metadata or {},
        "reasoning": _reasoning_echo(body),
        "background": body.background,
    }


def _reasoning_echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's `reasoning` settings as a Response reports them (taken, not acted on)."""
    given = body.reasoning
    if given is None:
        return {"effort": None, "summary": None}
    return {"effort": given.effort, "summary": given.summary or given.generate_summary}


def response_object(
    head: dict[str, Any],
    *,
    status: Literal["queued", "in_progress", "completed", "incomplete"],
    output: list[dict[str, Any]] | None = None,
    usage: ResponseUsage | None = None,
    structured: Any = None,
) -> Response:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return Response(
        **head,
        status=status,
        completed_at=int(time.time()) if status == "completed" else None,
        incomplete_details=incomplete,  # type: ignore[arg-type]
        output=output or [],
        usage=usage,
        structured=structured,
    )


def usage_of(usage: dict[str, Any], cached_tokens: int) -> ResponseUsage:
    """The Responses usage of a chat usage (`answers.Usage`, dumped)."""
    details = usage.get("completion_tokens_details") or {}
    return ResponseUsage(
        input_tokens=usage["prompt_tokens"],
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
        output_tokens=usage["completion_tokens"],
        output_tokens_details=OutputTokensDetails(reasoning_tokens=details.get("reasoning_tokens", 0)),
        total_tokens=usage["prompt_tokens"] + usage["completion_tokens"],
    )


def cached_tokens(started: list[Started]) -> int:
    """Prompt tokens served from the prefix cache."""
    return sum(first.num_cached_tokens for _, first in started)
