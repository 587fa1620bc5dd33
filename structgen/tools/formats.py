"""Tool-call formats: how calls are written in a model's output, and how a chat template is matched to one.

Every supported format is a run of JSON call objects `{"name": ..., "<args_key>": {...}}` with fixed text
around each call and between calls, so one description serves the grammar, the parser and the prompt side:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, newline
  between (Qwen2/Qwen3, NousResearch Hermes; also what we define for the ChatML templates of SmolLM2 and
  `tiny`, which have no format of their own). The default.
- `llama3_json`: `{"name": ..., "parameters": {...}}`, calls separated by `; ` (Llama 3.1-3.3 JSON tool calls).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- `json_array`: `[{"name": ..., "parameters": {...}}, ...]`, what vLLM's `tool_choice="required"` produces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """The fixed text of a tool-call block. A block is `begin`, then calls separated by `separator`, then
    `end`; each call is `call_open` + `{"name": <name>, "<args_key>": <arguments>}` + `call_close`.
    `trigger` is the text that starts a block when the model may also answer in text (`tool_choice="auto"`);
    it is a prefix of `begin + call_open + '{"name": "'`."""

    name: str
    args_key: str
    call_open: str = ""
    call_close: str = ""
    separator: str = ", "
    begin: str = ""
    end: str = ""
    trigger: str = ""

    def __post_init__(self) -> None:
        if not self.opening().startswith(self.trigger) or not self.trigger:
            raise ValueError(f"format {self.name}: the trigger must start every tool-call block")

    def opening(self) -> str:
        """The text every block starts with, up to the first function name."""
        return self.begin + self.call_open + '{"name": "'

    def call_head(self, name: str) -> str:
        """A call's fixed text up to its arguments."""
        return f'{self.call_open}{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": '

    def call_tail(self) -> str:
        return "}" + self.call_close

    def render_call(self, name: str, arguments: str) -> str:
        return self.call_head(name) + arguments + self.call_tail()

    def render_block(self, calls: list[tuple[str, str]]) -> str:
        """The text of a block of calls, `(name, arguments JSON)` each: what the model writes."""
        return self.begin + self.separator.join(self.render_call(n, a) for n, a in calls) + self.end


HERMES = ToolCallFormat(
    name="hermes",
    args_key="arguments",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    separator="\n",
    trigger="<tool_call>",
)
LLAMA3_JSON = ToolCallFormat(name="llama3_json", args_key="parameters", separator="; ", trigger='{"name": "')
MISTRAL = ToolCallFormat(
    name="mistral", args_key="arguments", begin="[TOOL_CALLS][", end="]", trigger="[TOOL_CALLS]"
)
JSON_ARRAY = ToolCallFormat(
    name="json_array", args_key="parameters", begin="[", end="]", trigger='[{"name": "'
)

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, JSON_ARRAY)}


def get_format(name: str) -> ToolCallFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template's model was trained on, told by its markers; `hermes` otherwise."""
    source = chat_template or ""
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|start_header_id|>" in source and ("<|python_tag|>" in source or '"parameters"' in source):
        return LLAMA3_JSON
    return HERMES


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a template renders `tools` and assistant `tool_calls` itself (else we render them)."""
    source = chat_template or ""
    return "tools" in source and "tool_calls" in source
