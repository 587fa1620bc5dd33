"""Request and response bodies of the OpenAI API (plus vLLM's extra request fields), as pydantic models.

Requests ignore unknown fields, as OpenAI does; each knows how to become `SamplingParams` so the routes stay
about HTTP. Responses are built with these models and dumped to JSON.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from structgen.engine.outputs import CompletionOutput
from structgen.sampling_params import SamplingParams
from structgen.server.errors import APIError
from structgen.server.structured_request import resolve_structured, structured_options

# OpenAI's ranges for the HTTP API, checked before any work starts. The offline `SamplingParams` keeps vLLM's
# wider ones (any temperature >= 0, any n), which scripts may rely on.
MAX_TEMPERATURE = 2.0
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's own limit
# OpenAI's default `max_tokens` for text completions (chat has none: the server's `max_tokens_default` caps it).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI does. Known ones are typed strictly, also as OpenAI does:
    # `"stream": "yes"` or `"n": "2"` is a 400, not coerced (an int still passes for a float); NaN and
    # infinities are no numbers.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingExtras(_Request):
    """Sampling fields every generation route takes, the Responses API included (where OpenAI has no such field,
    they are vLLM's): seed, stop, penalties, vLLM's sampling extras and structured-output fields."""

    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # vLLM's extras, sent by the `openai` SDK as top-level fields through `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class _SamplingFields(SamplingExtras):
    """Fields shared by chat and text completions: OpenAI's sampling options (and, inherited, vLLM's extras)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def structured_options(self) -> dict[str, Any]:
        """The options of `structured_outputs` (budget closing, loop guard, whitespace, strict), checked."""
        return structured_options(self.structured_outputs)

    def _structured(self, response_format: dict[str, Any] | None, *, has_tools: bool) -> Any:
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        return resolve_structured(
            response_format=response_format,
            guided=guided,
            structured_outputs=self.structured_outputs,
            has_tools=has_tools,
        )

    def _sampling_params(
        self,
        max_tokens: int | None,
        response_format: dict[str, Any] | None,
        logprobs: int | None,
        *,
        has_tools: bool = False,
        thinking_token_budget: int | None = None,
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
                structured_outputs=self._structured(response_format, has_tools=has_tools),
                thinking_token_budget=thinking_token_budget,
                **{k: v for k, v in optional.items() if v is not None},
            )
        except APIError:
            raise
        except ValueError as error:  # SamplingParams' messages start with the field's name
            raise APIError(400, str(error), param=self._param_of(error), code="invalid_value") from None

    def _param_of(self, error: ValueError) -> str | None:
        head = str(error).split(" ", 1)[0]
        return head if head in type(self).model_fields else None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier assistant turn's reasoning, as vLLM (`reasoning`, `reasoning_content`) answers it: handed to the
    # chat template, which decides what of it the prompt keeps (Qwen3's drops it from turns before the last query).
    reasoning: str | None = None
    reasoning_content: str | None = None

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
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling (checked and applied by `structgen.server.tool_calls`).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (`serve --reasoning-parser`), in vLLM's terms: the most tokens the reasoning may take before
    # the answer is forced to start (unset: the server's `--thinking-token-budget`); keyword arguments for the
    # chat template (`{"enable_thinking": false}` turns Qwen3's reasoning off; checked in `chat_prompt`); and
    # whether the answer reports the reasoning (false: `reasoning` / `reasoning_content` stay null).
    thinking_token_budget: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True

    @property
    def max_tokens_given(self) -> bool:
        """Whether the request caps its output itself; if not, the server's default cap applies."""
        return self.max_completion_tokens is not None or self.max_tokens is not None

    def to_sampling_params(self) -> SamplingParams:
        """The params as the request gives them; without a max_tokens the route sets the server's cap, which
        depends on the prompt's length (`structgen.server.limits.with_default_max_tokens`)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        has_tools = self.tools is not None or self.tool_choice is not None
        return self._sampling_params(
            max_tokens,
            self.response_format,
            logprobs,
            has_tools=has_tools,
            thinking_token_budget=self.thinking_token_budget,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
            raise APIError(400, "echo with logprobs is not supported", param="echo")
        # `null` is OpenAI's default too, never "until the context is full" (which vLLM reads it as).
        max_tokens = self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return self._sampling_params(max_tokens, None, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(prompt)  # type: ignore[arg-type]


# -- responses ------------------------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # output tokens spent before the answer (the reasoning and its markers)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Only where the engine has a reasoning parser; left out (not null) elsewhere, so a server without one keeps
    # the usage shape it always had.
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_empty_details(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if data.get("completion_tokens_details", 0) is None:
            del data["completion_tokens_details"]
        return data


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "structgen"
    # vLLM's: what the model was loaded from (a LoRA adapter's directory), and the model an adapter applies to.
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    # None (sent as null, which the `openai` SDK reads as no tool calls) unless the model called tools.
    tool_calls: list[dict[str, Any]] | None = None
    # With a reasoning parser: what the model reasoned before `content` (markers left out), under vLLM's newer
    # name and DeepSeek's older one, which clients read; null when the output had no reasoning phase, or with
    # `include_reasoning: false`.
    reasoning: str | None = None
    reasoning_content: str | None = None


class StructuredInfo(BaseModel):
    """How a structured choice was served (the engine's `StructuredReport`): the grammar backend, the serving
    path (exact / rewritten / restricted / relaxed), whether the output validates, the resamples it took,
    whether it was closed at the budget (steered onto its shortest valid completion as `max_tokens` or the
    context ran out: it finished "stop" where it would have been cut) and how many looping values the loop
    guard ended, and how many of its tokens the grammar forced (jump-forward: appended without sampling, part of
    `usage.completion_tokens`). An extension of OpenAI's shape: SDKs keep it as an extra field."""

    backend: str | None
    path: str | None
    valid: bool | None
    retries: int
    closed_at_budget: bool
    loops_ended: int
    forced_tokens: int = 0

    @classmethod
    def of(cls, output: CompletionOutput) -> StructuredInfo | None:
        """The report of a structured output; None for an unconstrained one."""
        report = output.structured
        if report is None:
            return None
        return cls(
            backend=report.backend,
            path=report.path,
            valid=report.valid,
            retries=report.retries,
            closed_at_budget=report.closed_at_budget,
            loops_ended=report.loops_ended,
            forced_tokens=report.forced_tokens,
        )


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    structured: StructuredInfo | None = None  # null for unconstrained requests


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
    # A reasoning delta, under both names as on `AssistantMessage`; the keys are left out of other chunks.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    # Only on the chunk carrying a structured choice's finish_reason (`streaming.py` drops the key elsewhere).
    structured: StructuredInfo | None = None


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
    # Null for unconstrained requests; in a stream, only on the chunk that finishes the choice (`ChatChunkChoice`).
    structured: StructuredInfo | None = None


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
