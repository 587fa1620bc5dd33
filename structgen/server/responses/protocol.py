"""Request and response bodies of OpenAI's Responses API, as pydantic models.

The request is typed as strictly as chat's (`structgen.server.protocol`): unknown fields are ignored, known
ones are not coerced. Input items, tools and `text.format` stay plain JSON here; `convert.py` checks them
while it turns them into chat terms, so its 400s name the exact item (`input[2].content[0].type`). The
sampling extras chat accepts (`seed`, `stop`, penalties, vLLM's `top_k`, `guided_*`, `structured_outputs`...)
come from the same mixin, so they are accepted, checked and named the same way here.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from structgen.server.answers import StructuredInfo
from structgen.server.protocol import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, SamplingExtras
from structgen.server.protocol import _Request as _Body  # chat's strict request config, shared on purpose

# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# The `include` value asking for the logprobs of the output text.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextConfig(_Body):
    """`text`: the output format (`{"type": "text" | "json_object" | "json_schema", ...}`, checked in
    `convert.py`) and a verbosity hint, which this server takes and ignores."""

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    """`reasoning`: OpenAI's effort and summary settings, accepted and echoed but not acted on. A reasoning
    model here reasons as its chat template has it; `thinking_token_budget` (and `chat_template_kwargs`, e.g.
    `{"enable_thinking": false}`) are this server's knobs. Effort is any string, so newer levels pass too."""

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the deprecated name of `summary`


class ResponsesRequest(SamplingExtras):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    stream: bool = False
    background: bool = False
    user: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    # vLLM's reasoning fields, as chat takes them (`ChatCompletionRequest`).
    thinking_token_budget: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"key {key[:20]!r}... is longer than {MAX_METADATA_KEY} characters")
            if len(text) > MAX_METADATA_VALUE:
                raise ValueError(f"the value of {key!r} is longer than {MAX_METADATA_VALUE} characters")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # the SDK's model requires it; this server has no paid cache writes


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """OpenAI's Response object. Output items are plain JSON (`output.py` builds them): a `reasoning` item with
    `reasoning_text` content (with a reasoning parser), `message` items with `output_text` parts and
    `function_call` items. `structured` is this server's extension, as on chat choices:
    how a structured output was served (null for unconstrained ones); SDKs keep it as an extra field."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int | None = None
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    structured: StructuredInfo | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def new_id(prefix: str) -> str:
    """An id in OpenAI's Responses style (`resp_…`, `rs_…`, `msg_…`, `fc_…`): an underscore, then 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"
