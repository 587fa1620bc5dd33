"""Response bodies of the OpenAI API (plus structgen's and vLLM's extensions), as pydantic models: the routes
build them and dump them to JSON. The request bodies are in `protocol.py`."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, GetJsonSchemaHandler, SerializerFunctionWrapHandler, model_serializer

from structgen.engine.outputs import CompletionOutput

# vLLM's `prompt_logprobs` answer: per prompt token (null for the first), its logprob and its alternatives', keyed
# by token id (`logprobs_body.vllm_prompt_logprobs`).
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class _LeanModel(BaseModel):
    """A response model whose extension fields (`omitted_when_null`) are left out of the JSON where null, not
    sent as null: they come only when asked for (or where they apply), so other answers keep the shape they
    always had."""

    omitted_when_null: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for key in self.omitted_when_null:
            if data.get(key, 0) is None:
                del data[key]
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        # The OpenAPI document shows the fields (those keys optional), not the empty schema pydantic gives a
        # wrap serializer's `Any`.
        return handler({k: v for k, v in schema.items() if k != "serialization"})


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # output tokens spent before the answer (the reasoning and its markers)


class Usage(_LeanModel):
    omitted_when_null = ("completion_tokens_details",)

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Only where the engine has a reasoning parser; left out (not null) elsewhere, so a server without one keeps
    # the usage shape it always had.
    completion_tokens_details: CompletionTokensDetails | None = None


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


class ChatCompletion(_LeanModel):
    omitted_when_null = ("prompt_logprobs",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with its `prompt_logprobs` field only


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


class CompletionChoice(_LeanModel):
    omitted_when_null = ("prompt_logprobs",)

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None
    # Null for unconstrained requests; in a stream, only on the chunk that finishes the choice (`ChatChunkChoice`).
    structured: StructuredInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with its `prompt_logprobs` field only


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
