"""Typed tools: OpenAI tool schemas from Python functions or Pydantic models, and tool calls decoded back into
validated argument objects.

A function's arguments become a Pydantic model built from its signature (type hints, defaults) with the
docstring's first paragraph as the tool's description and its Google-style `Args:` lines as the parameters'
descriptions. A Pydantic model is a tool whose arguments are the model itself (its docstring describes it);
it has nothing to run, so in an agent loop a call to it ends the loop (the "final answer as a tool" pattern).
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, ValidationError, create_model

from structgen.client.errors import OutputValidationError
from structgen.client.targets import strict_schema

_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


@dataclass(slots=True, frozen=True)
class Tool:
    """One tool offered to the model: its name, description, argument model and (for functions) callable."""

    name: str
    description: str | None
    arguments: type[BaseModel]
    function: Callable[..., Any] | None = None

    def spec(self) -> dict[str, Any]:
        """The tool as OpenAI's `tools[]` entry (strict parameters, as for `parse`)."""
        function: dict[str, Any] = {
            "name": self.name,
            "parameters": strict_schema(self.arguments.model_json_schema()),
            "strict": True,
        }
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(slots=True)
class ToolCall:
    """A call the model made: the tool, its validated arguments, and after `run()` the result."""

    id: str
    tool: Tool
    arguments: BaseModel
    result: Any = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.tool.name

    def run(self) -> Any:
        """Call the function with the validated arguments (for a coroutine function: the awaitable)."""
        if self.tool.function is None:
            raise TypeError(f"the tool {self.name!r} is a model, not a function: there is nothing to run")
        kwargs = {name: getattr(self.arguments, name) for name in type(self.arguments).model_fields}
        return self.tool.function(**kwargs)


@dataclass(slots=True)
class ToolRun:
    """The outcome of an agent loop (`run_tools=True`): every call made (with its result), the final text
    answer and the whole conversation. `finish_reason` is the last reply's (`"stop"`, or `"length"` for a text
    answer cut at `max_tokens`), `"model_tool"` when a call to a model tool ended the loop, or `"max_steps"`;
    `content` is None in the last two cases."""

    calls: list[ToolCall]
    content: str | None
    messages: list[dict[str, Any]]
    steps: int
    finish_reason: str | None


def as_tool(obj: Any) -> Tool:
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and issubclass(obj, BaseModel):
        return Tool(obj.__name__, _doc(obj)[0], obj)
    if callable(obj):
        return _function_tool(obj)
    raise TypeError(f"a tool must be a function or a Pydantic model class, got {obj!r}")


def _function_tool(func: Callable[..., Any]) -> Tool:
    name = getattr(func, "__name__", None)
    if not name or name == "<lambda>":
        raise TypeError(f"a tool function needs a name, got {func!r}")
    hints = typing.get_type_hints(func, include_extras=True)
    description, arg_docs = _doc(func)
    fields: dict[str, Any] = {}
    for param in inspect.signature(func).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {name!r}: parameter {param.name!r} must be passable by keyword")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (
            hints.get(param.name, Any),
            Field(default, description=arg_docs.get(param.name)),
        )
    try:
        model = create_model(f"{name}_arguments", **fields)
    except Exception as error:  # pydantic refuses some names (`_private`, `model_config`) and some types
        raise TypeError(f"tool {name!r}: cannot build an argument model: {error}") from None
    return Tool(name, description, model, func)


def _doc(obj: Any) -> tuple[str | None, dict[str, str]]:
    """The first paragraph of `obj`'s docstring, and its `Args:` section as name -> description."""
    doc = inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    summary = " ".join(paragraphs[0].split()) if paragraphs and not _is_section(paragraphs[0]) else None
    args: dict[str, str] = {}
    lines = doc.splitlines()
    if "Args:" in (line.strip() for line in lines):
        start = [line.strip() for line in lines].index("Args:") + 1
        for line in lines[start:]:
            if line.strip() and not line.startswith((" ", "\t")):
                break  # the next section
            if match := _ARG_LINE.match(line):
                args[match[1].lstrip("*")] = match[2].strip()
    return summary, args


def _is_section(paragraph: str) -> bool:
    return paragraph.splitlines()[0].strip() in {"Args:", "Returns:", "Raises:"}


def tool_choice(choice: str, tools: dict[str, Tool]) -> str | dict[str, Any]:
    """OpenAI's `tool_choice` for `"auto" | "required" | "none"` or a tool's name."""
    if choice in ("auto", "required", "none"):
        return choice
    if choice not in tools:
        raise ValueError(f"tool_choice {choice!r} is neither auto/required/none nor one of {sorted(tools)}")
    return {"type": "function", "function": {"name": choice}}


def decode_calls(message: dict[str, Any], tools: dict[str, Tool]) -> list[ToolCall]:
    """The typed calls of an assistant message; `OutputValidationError` for an unknown tool or bad arguments."""
    calls = []
    for raw in message.get("tool_calls") or []:
        function = raw.get("function") or {}
        name, text = function.get("name"), function.get("arguments")
        if name not in tools:
            raise OutputValidationError(f"the model called an unknown tool {name!r}", raw_text=text)
        tool = tools[name]
        try:
            arguments = tool.arguments.model_validate(json.loads(text) if isinstance(text, str) else text)
        except (json.JSONDecodeError, TypeError) as error:
            raise OutputValidationError(
                f"the arguments of {name!r} are not JSON: {error}", raw_text=text
            ) from None
        except ValidationError as error:
            raise OutputValidationError(
                f"the arguments of {name!r} are invalid: {error}", raw_text=text, errors=error.errors()
            ) from None
        calls.append(ToolCall(str(raw.get("id") or f"call_{len(calls)}"), tool, arguments))
    return calls


def result_message(call: ToolCall) -> dict[str, Any]:
    """The `role: "tool"` message that reports `call.result` back to the model (JSON unless it is a str)."""
    result = call.result
    if isinstance(result, BaseModel):
        content = result.model_dump_json()
    elif isinstance(result, str):
        content = result
    else:
        content = json.dumps(result, ensure_ascii=False, default=str)
    return {"role": "tool", "tool_call_id": call.id, "content": content}
