"""Request and response bodies of the OpenAI API (plus vLLM's extra request fields), as pydantic models.

Requests ignore unknown fields, as OpenAI does; each knows how to become `SamplingParams` so the routes stay
about HTTP. Responses are built with these models and dumped to JSON.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from structgen.engine.outputs import TokenLogprob
from structgen.sampling_params import SamplingParams
from structgen.server.errors import APIError


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by chat and text completions: OpenAI's sampling options and vLLM's extras."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM's extras, sent by the `openai` SDK as top-level fields through `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def _structured(self, response_format: dict[str, Any] | None) -> Any:
        from structgen.structured import StructuredOutputsParams

        given = {
            name: value
            for name, value in (
                (
                    "response_format",
                    response_format if (response_format or {}).get("type") != "text" else None,
                ),
                ("guided_json", self.guided_json),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
                ("guided_grammar", self.guided_grammar),
                ("structured_outputs", self.structured_outputs),
            )
            if value is not None
        }
        if len(given) > 1:
            raise APIError(400, f"set at most one of {', '.join(given)}", param=next(iter(given)))
        if not given:
            return None
        name, value = next(iter(given.items()))
        if name == "response_format":
            return StructuredOutputsParams.from_response_format(value)
        if name == "structured_outputs":
            known = {
                "json",
                "json_object",
                "regex",
                "grammar",
                "choice",
                "whitespace",
                "max_whitespace",
                "strict",
            }
            unknown = sorted(set(value) - known)
            if unknown:
                raise APIError(400, f"unknown structured_outputs field(s): {', '.join(unknown)}", param=name)
            return StructuredOutputsParams(**value)
        key = name.removeprefix("guided_")
        return StructuredOutputsParams(**{key: value})

    def _sampling_params(
        self, max_tokens: int | None, response_format: dict[str, Any] | None, logprobs: int | None
    ) -> SamplingParams:
        """The engine's view of this request; a bad value is a 400 that names the field."""
        try:
            optional = {
                "temperature": self.temperature,
                "top_p": self.top_p,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "top_k": self.top_k,
                "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
            }
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                seed=self.seed,
                stop=self.stop,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                min_tokens=self.min_tokens,
                structured_outputs=self._structured(response_format),
                **{k: v for k, v in optional.items() if v is not None},
            )
        except APIError:
            raise
        except ValueError as error:  # SamplingParams and InvalidSpecError name the field
            raise APIError(400, str(error), code="invalid_value") from None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"only text content parts are supported, got {part.get('type')!r}",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = content or ""
        for key in ("name", "tool_calls", "tool_call_id"):
            if (value := getattr(self, key)) is not None:
                message[key] = value
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (checked and applied by `structgen.server.tool_calls`).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, self.response_format, logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for text completions
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
            raise APIError(400, "echo with logprobs is not supported", param="echo")
        return self._sampling_params(self.max_tokens, None, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(prompt)  # type: ignore[arg-type]


# -- responses ------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "structgen"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    # None (sent as null, which the `openai` SDK reads as no tool calls) unless the model called tools.
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    refusal: None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _token_text(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for these sampled tokens."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [
        one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top_logprobs]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprob], *, offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs` object; `offset` is where the first token starts in the choice's text."""
    tokens = [_token_text(tokenizer, e.token_id)[0] for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(tokenizer, t)[0]: lp for t, lp in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }
