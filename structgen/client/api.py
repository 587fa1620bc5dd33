"""The public methods `Client` and `AsyncClient` share: each turns its arguments into a flow (see `core`) and
hands it to the subclass's driver, which returns the value (`Client`) or an awaitable of it (`AsyncClient`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from structgen.client.core import ClientOptions, Core, Flow
from structgen.client.stream import ReasoningStreamDecoder, StreamDecoder


class ClientAPI:
    """Typed access to any OpenAI-compatible chat completions server (structgen's own, vLLM, OpenAI...).

    `base_url` is the server's root, with or without `/v1` (default: `$STRUCTGEN_BASE_URL`, else
    `http://127.0.0.1:8000`); `api_key` defaults to `$STRUCTGEN_API_KEY`; `model=None` uses the first model
    `/v1/models` lists. Connection errors, 429 and 5xx are retried `max_retries` times with exponential backoff
    (honouring `Retry-After`); `transport` replaces httpx's (tests, ASGI apps)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 2,
        transport: Any = None,
    ) -> None:
        options = ClientOptions.make(
            base_url=base_url, api_key=api_key, model=model, timeout=timeout, max_retries=max_retries
        )
        self._core = Core(options)
        self._http = self._http_class(
            base_url=options.base_url, headers=options.headers(), timeout=options.timeout, transport=transport
        )

    @property
    def base_url(self) -> str:
        return self._core.options.base_url

    def models(self) -> Any:
        """The model ids the server lists."""
        return self._run(self._core.models())

    def parse(
        self,
        target: Any,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        strict: bool = True,
        **sampling: Any,
    ) -> Any:
        """Ask for a value of type `target` (a Pydantic model, any `TypeAdapter`-able type, or a JSON Schema
        dict) and return it validated; with `n > 1`, a list of `n` values. Give the conversation as `messages`
        or a single user `prompt`. `sampling` takes the request's other fields (`temperature`, `max_tokens`,
        `seed`, `stop`...), sent as given. `strict` is sent as `response_format.json_schema.strict`.

        Raises `TruncatedOutputError` when `max_tokens` cut the value short, `OutputValidationError` when the
        output is not valid for `target`, `APIStatusError` subclasses for HTTP errors."""
        return self._run(self._core.parse(target, messages, prompt, strict=strict, sampling=sampling))

    def stream_parse(
        self,
        target: Any,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        strict: bool = True,
        **sampling: Any,
    ) -> Any:
        """Stream the answer (`n` must be 1): yields each new partial value as plain JSON (dicts and lists, by
        the rule in `structgen.client.partial`), and last the validated value, equal to what `parse` returns
        for the same request."""
        flow = self._core.parse_request(
            target, messages, prompt, strict=strict, stream=True, sampling=sampling
        )
        return self._stream(flow, StreamDecoder)

    def parse_with_reasoning(
        self,
        target: Any,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        strict: bool = True,
        **sampling: Any,
    ) -> Any:
        """`parse` for reasoning models: returns a `Parsed` (with `n > 1`, a list of them) holding the value and
        the reasoning the server reported beside the answer (`message.reasoning` or `reasoning_content`; None
        when it reported none). The value is validated as `parse` does and its errors are the same; they carry
        the reasoning too. Reasoning options go in `sampling` like any other field: `thinking_token_budget=N`
        (structgen, vLLM), `chat_template_kwargs={"enable_thinking": False}`, `include_reasoning=False`."""
        flow = self._core.parse(
            target, messages, prompt, strict=strict, sampling=sampling, with_reasoning=True
        )
        return self._run(flow)

    def stream_parse_with_reasoning(
        self,
        target: Any,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        strict: bool = True,
        **sampling: Any,
    ) -> Any:
        """`stream_parse` for reasoning models (`n` must be 1): yields a `Parsed` snapshot (`done=False`) each
        time the reasoning or the partial value grew — the reasoning so far, and the partial value so far
        (`MISSING` while the model still reasons) — and last the `Parsed` of the validated value (`done=True`),
        equal to what `parse_with_reasoning` returns for the same request."""
        flow = self._core.parse_request(
            target, messages, prompt, strict=strict, stream=True, sampling=sampling
        )
        return self._stream(flow, ReasoningStreamDecoder)

    def call_tools(
        self,
        tools: Sequence[Any],
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        tool_choice: str = "auto",
        run_tools: bool = False,
        max_steps: int = 5,
        **sampling: Any,
    ) -> Any:
        """Offer `tools` (functions or Pydantic models) and return the typed `ToolCall`s the model made (`[]`
        when it answered in text). `tool_choice` is `"auto"`, `"required"`, `"none"` or a tool's name.

        With `run_tools=True`, runs each called function with its validated arguments, sends the results back
        as `role: "tool"` messages and repeats until the model answers in text or calls a model tool, for at
        most `max_steps` rounds, returning a `ToolRun`. A forced `tool_choice` applies to the first round only
        (forcing every round would never let the model answer). An exception in a tool propagates."""
        flow = self._core.call_tools(
            tools,
            messages,
            prompt,
            choice=tool_choice,
            run_tools=run_tools,
            max_steps=max_steps,
            sampling=sampling,
        )
        return self._run(flow)

    # -- what a driver provides -----------------------------------------------------------------------------

    _http_class: Any  # httpx.Client or httpx.AsyncClient

    def _run(self, flow: Flow[Any]) -> Any:
        raise NotImplementedError

    def _stream(self, flow: Flow[Any], decoder_class: type[StreamDecoder]) -> Any:
        raise NotImplementedError
