"""`ToolCallPlan`: everything one tool-calling request needs, built once from `tools` / `tool_choice` and the
model's chat template — the prompt messages, the structured-output constraint, and the output parsers."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from structgen.tools.definitions import (
    ToolChoice,
    ToolDefinition,
    ToolError,
    parse_tool_choice,
    parse_tools,
)
from structgen.tools.formats import ToolCallFormat, detect_format, get_format, template_supports_tools
from structgen.tools.grammar import TextAnswer, arguments_schema, tool_call_grammar
from structgen.tools.parser import ParsedOutput, parse_tool_calls
from structgen.tools.render import render_conversation
from structgen.tools.streaming import StreamingToolParser

if TYPE_CHECKING:
    from structgen.sampling_params import SamplingParams
    from structgen.structured import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class ToolCallPlan:
    tools: tuple[ToolDefinition, ...]
    choice: ToolChoice
    format: ToolCallFormat
    template_supports_tools: bool = False

    @classmethod
    def build(
        cls,
        tools: Sequence[Any] | None,
        tool_choice: Any = None,
        *,
        parallel_tool_calls: bool | None = None,
        chat_template: str | None = None,
        format: str | None = None,
    ) -> ToolCallPlan:
        """Validate the request's tools and choice (ToolError on bad input) and pick the call format from the
        chat template (or `format` by name)."""
        parsed = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, parsed, parallel_tool_calls=parallel_tool_calls)
        if choice.mode != "none":
            for tool in parsed:
                arguments_schema(tool)  # an arguments schema that cannot be served fails now, naming its tool
        fmt = get_format(format) if format is not None else detect_format(chat_template)
        return cls(tuple(parsed), choice, fmt, template_supports_tools(chat_template))

    @property
    def active(self) -> bool:
        """Whether the model is offered tools at all (`tool_choice` other than none)."""
        return self.choice.mode != "none" and bool(self.tools)

    def conversation(
        self, messages: Sequence[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, `tools=` for the chat template) for this request."""
        return render_conversation(
            messages,
            self.tools if self.active else (),
            self.format,
            template_supports_tools=self.template_supports_tools,
        )

    def structured_outputs(
        self, *, answer: TextAnswer | None = None, **options: Any
    ) -> StructuredOutputsParams | None:
        """The grammar the output is generated under; None with `tool_choice="none"`. `answer`: the JSON Schema
        a text answer follows instead of being free (`auto` only). `options` are the other
        `StructuredOutputsParams` fields (`close_at_budget`, `loop_guard`, `whitespace`, `strict`...)."""
        if not self.active:
            return None
        from structgen.structured import StructuredOutputsParams

        grammar = tool_call_grammar(self.tools, self.choice, self.format, answer=answer)
        return StructuredOutputsParams(grammar=grammar, **options)

    def sampling_params(
        self, params: SamplingParams | None, *, options: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """`params` constrained by this plan's grammar, with `options` (see `structured_outputs`) applied to it.

        A constraint the request carries itself (`response_format`, OpenAI's `text.format`) shapes the text
        answer, as OpenAI has it, not the calls: with `required` or a named function there is no text to
        shape, so it is moot; with `auto` a JSON one becomes the grammar's answer branch (JSON, or calls);
        another kind (regex, choice, a grammar) cannot be joined to the calls and is refused."""
        from structgen.sampling_params import SamplingParams

        params = params if params is not None else SamplingParams()
        answer = None
        if self.active and params.structured_outputs is not None and self.choice.mode == "auto":
            answer = answer_schema(params.structured_outputs)
        structured = self.structured_outputs(answer=answer, **(options or {}))
        if structured is None:
            return params
        return replace(params, structured_outputs=structured)

    def parse(self, text: str) -> ParsedOutput:
        if not self.active:
            return ParsedOutput(text, [])
        return parse_tool_calls(text, self.format, self.tools)

    def stream_parser(self) -> StreamingToolParser:
        return StreamingToolParser(self.format, self.tools)


def answer_schema(text_format: StructuredOutputsParams) -> TextAnswer:
    """The JSON a text answer must be, from the request's own constraint (JSON kinds only)."""
    from structgen.structured.llguidance_backend import json_options

    spec = text_format.to_spec()
    if spec.kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if spec.kind == "json_object" else json.loads(spec.text)
        return TextAnswer(schema, json_options(spec))
    raise ToolError(
        f"tools with tool_choice 'auto' combine only with a JSON response format (json_schema, json_object), "
        f"not {spec.kind}: the answer is either that JSON or tool calls; use tool_choice 'required' or "
        "'none', or drop the constraint",
        param="tool_choice",
    )
