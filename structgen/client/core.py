"""The operations `Client` and `AsyncClient` share, free of I/O: request bodies and response decoding (the
retry policy is in `retry`, the SSE decoder in `stream`).

An operation that needs several round trips (look up the model, then ask; or an agent loop) is a generator
that yields what it needs done — `Call` (an HTTP request; it is sent back the decoded JSON) or `Invoke` (run
a tool function; it is sent back the result) — and returns its value. The sync and async clients differ only
in the small drivers that carry these out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from structgen.client.errors import (
    ClientError,
    OutputError,
    OutputValidationError,
    TruncatedOutputError,
)
from structgen.client.reasoning import Parsed, reasoning_text, reasoning_tokens
from structgen.client.targets import Target, as_target
from structgen.client.tools import Tool, ToolCall, ToolRun, as_tool, decode_calls, result_message, tool_choice

T = TypeVar("T")
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


@dataclass(slots=True, frozen=True)
class Call:
    method: str
    path: str  # relative to `<base_url>/v1/`
    body: dict[str, Any] | None = None


@dataclass(slots=True, frozen=True)
class Invoke:
    call: ToolCall


Flow = Generator["Call | Invoke", Any, T]


@dataclass(slots=True)
class ClientOptions:
    base_url: str
    api_key: str | None
    model: str | None
    timeout: float
    max_retries: int

    @classmethod
    def make(
        cls, *, base_url: str | None, api_key: str | None, model: str | None, timeout: float, max_retries: int
    ) -> ClientOptions:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        base = (base_url or os.environ.get("STRUCTGEN_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        key = api_key if api_key is not None else os.environ.get("STRUCTGEN_API_KEY")
        return cls(base + "/", key, model, timeout, max_retries)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "structgen-client"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


# -- operations ---------------------------------------------------------------------------------------------


def conversation(messages: Sequence[dict[str, Any]] | None, prompt: str | None) -> list[dict[str, Any]]:
    if (messages is None) == (prompt is None):
        raise ValueError("pass exactly one of messages=[...] or prompt='...'")
    if prompt is not None:
        return [{"role": "user", "content": prompt}]
    assert messages is not None
    if not messages:
        raise ValueError("messages must not be empty")
    return [dict(m) for m in messages]


class Core:
    """The operations, as flows; `options.model` is filled in from `/v1/models` on first need."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options

    def model(self) -> Flow[str]:
        if self.options.model is None:
            data = yield Call("GET", "models")
            try:
                self.options.model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise ClientError(f"the server lists no model at /v1/models: {data!r}") from None
        return self.options.model

    def models(self) -> Flow[list[str]]:
        data = yield Call("GET", "models")
        return [str(card["id"]) for card in data.get("data", [])]

    def chat_body(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Flow[dict[str, Any]]:
        model = sampling.pop("model", None) or (yield from self.model())
        fields = {key: value for key, value in sampling.items() if value is not None}
        return {"model": model, "messages": messages, **fields}

    def parse_request(
        self,
        target: Any,
        messages: Sequence[dict[str, Any]] | None,
        prompt: str | None,
        *,
        strict: bool,
        stream: bool,
        sampling: dict[str, Any],
    ) -> Flow[tuple[Target, dict[str, Any]]]:
        resolved = as_target(target)
        if stream and (sampling.get("n") or 1) != 1:
            raise ValueError("stream_parse streams one choice: n must be 1")
        extra: dict[str, Any] = {"response_format": resolved.response_format(strict=strict)}
        if stream:
            extra["stream"] = True
        body = yield from self.chat_body(conversation(messages, prompt), {**sampling, **extra})
        return resolved, body

    def parse(
        self,
        target: Any,
        messages: Sequence[dict[str, Any]] | None,
        prompt: str | None,
        *,
        strict: bool,
        sampling: dict[str, Any],
        with_reasoning: bool = False,
    ) -> Flow[Any]:
        """The value (or `n` values); `with_reasoning`: each as a `Parsed` that also holds the reasoning."""
        resolved, body = yield from self.parse_request(
            target, messages, prompt, strict=strict, stream=False, sampling=sampling
        )
        data = yield Call("POST", "chat/completions", body)
        tokens = reasoning_tokens(data)
        values = []
        for choice in sorted(_choices(data), key=lambda c: c.get("index", 0)):
            message = choice.get("message") or {}
            reasoning = reasoning_text(message)
            value = decode_output(
                resolved, message.get("content"), choice.get("finish_reason"), reasoning=reasoning
            )
            values.append(Parsed(value, reasoning, tokens) if with_reasoning else value)
        return values if (sampling.get("n") or 1) != 1 else values[0]

    def call_tools(
        self,
        functions: Sequence[Any],
        messages: Sequence[dict[str, Any]] | None,
        prompt: str | None,
        *,
        choice: str,
        run_tools: bool,
        max_steps: int,
        sampling: dict[str, Any],
    ) -> Flow[list[ToolCall] | ToolRun]:
        tools: dict[str, Tool] = {}
        for tool in map(as_tool, functions):
            if tool.name in tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            tools[tool.name] = tool
        if not tools:
            raise ValueError("call_tools needs at least one tool")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if (sampling.get("n") or 1) != 1:
            raise ValueError("call_tools takes one choice: n must be 1")
        history = conversation(messages, prompt)
        specs = [tool.spec() for tool in tools.values()]
        wire_choice = tool_choice(choice, tools)
        made: list[ToolCall] = []
        for step in range(1, max_steps + 1):
            body = yield from self.chat_body(
                history, {**sampling, "tools": specs, "tool_choice": wire_choice}
            )
            data = yield Call("POST", "chat/completions", body)
            first = min(_choices(data), key=lambda c: c.get("index", 0))
            message, finish_reason = first.get("message") or {}, first.get("finish_reason")
            # A text answer cut short is still an answer (`ToolRun.finish_reason` says so); cut-off calls are not.
            if finish_reason == "length" and (message.get("tool_calls") or not run_tools):
                raw = message.get("content") or json.dumps(message.get("tool_calls"))
                raise TruncatedOutputError("the reply stopped at max_tokens", raw_text=raw)
            calls = decode_calls(message, tools)
            if not run_tools:
                return calls
            history.append(
                {
                    "role": "assistant",
                    "content": message.get("content"),
                    "tool_calls": message.get("tool_calls"),
                }
                if calls
                else {"role": "assistant", "content": message.get("content") or ""}
            )
            made.extend(calls)
            if not calls:
                return ToolRun(made, message.get("content"), history, step, finish_reason)
            if any(call.tool.function is None for call in calls):
                return ToolRun(made, None, history, step, "model_tool")  # the final (structured) answer
            for call in calls:
                call.result = yield Invoke(call)
                history.append(result_message(call))
            # Forcing a call again would never let the model answer: after the first round it chooses.
            wire_choice = "auto" if wire_choice != "none" else wire_choice
        return ToolRun(made, None, history, max_steps, "max_steps")


def _choices(data: Any) -> list[dict[str, Any]]:
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices:
        raise ClientError(f"the response has no choices: {str(data)[:200]}")
    return list(choices)


def decode_output(
    target: Target, text: str | None, finish_reason: str | None, *, reasoning: str | None = None
) -> Any:
    """The validated value of a finished choice; an `OutputError` (carrying text and reasoning) otherwise."""
    if finish_reason == "length":
        hint = "raise max_tokens"
        if reasoning and not text:
            hint += ", or bound the reasoning with thinking_token_budget"  # the reasoning took every token
        raise TruncatedOutputError(
            f"the output stopped at max_tokens before the value was complete ({hint})",
            raw_text=text,
            reasoning=reasoning,
        )
    if finish_reason not in (None, "stop"):
        raise OutputValidationError(
            f"the output ended with finish_reason {finish_reason!r}", raw_text=text, reasoning=reasoning
        )
    try:
        return target.load(text)
    except OutputError as error:
        error.reasoning = reasoning
        raise
