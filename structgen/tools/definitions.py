"""OpenAI tool definitions and `tool_choice`, checked up front so a bad request fails naming the tool at fault."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from structgen.errors import StructgenError

ToolMode = Literal["none", "auto", "required", "named"]
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# OpenAI's rule for function names.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_MAX_NAME_LENGTH = 64


class ToolError(StructgenError, ValueError):
    """A tool definition or a `tool_choice` is invalid; `param` names the request field (OpenAI-style)."""

    def __init__(self, message: str, *, param: str = "tools") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    """One function the model may call. `parameters` is its JSON Schema (an object schema)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None
    strict: bool = False

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI shape, which is also what chat templates take as `tools`."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What the model may do: `none` (text only), `auto` (text or calls), `required` (one or more calls) or
    `named` (calls to `name` only). `parallel`: more than one call allowed. `allowed` (OpenAI's
    `allowed_tools`): the functions `auto` / `required` may call, None for all of them; every tool is still
    shown to the model, so the prompt (and its prefix cache) stays the same while the choice narrows."""

    mode: ToolMode
    name: str | None = None
    parallel: bool = True
    allowed: tuple[str, ...] | None = None

    def permits(self, name: str) -> bool:
        """Whether a call to `name` may be generated."""
        if self.mode == "named":
            return name == self.name
        return self.allowed is None or name in self.allowed


def parse_tools(tools: Sequence[Any] | None) -> list[ToolDefinition]:
    """OpenAI `tools` (dicts, or pydantic models such as the SDK's) → definitions; raises ToolError."""
    if tools is None:
        return []
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise ToolError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    parsed: list[ToolDefinition] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(tools):
        tool = _tool(_plain(raw), index)
        if tool.name in seen:
            raise ToolError(
                f"tools[{index}]: duplicate function name {tool.name!r} (also tools[{seen[tool.name]}])"
            )
        seen[tool.name] = index
        parsed.append(tool)
    return parsed


def parse_tool_choice(
    tool_choice: Any, tools: Sequence[ToolDefinition], *, parallel_tool_calls: bool | None = None
) -> ToolChoice:
    """OpenAI `tool_choice` against the parsed tools; default `auto` with tools, `none` without."""
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if not tools:
        raise ToolError("tool_choice is set but no tools were given", param="tool_choice")
    choice = _plain(tool_choice)
    if choice in ("none", "auto", "required"):
        return ToolChoice(choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if not isinstance(name, str):
            raise ToolError("tool_choice.function.name must be a string", param="tool_choice")
        known = [t.name for t in tools]
        if name not in known:
            raise ToolError(
                f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(known)})",
                param="tool_choice",
            )
        return ToolChoice("named", name=name, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed_tools(choice, tools, parallel)
    raise ToolError(
        "tool_choice must be 'none', 'auto', 'required', "
        '{"type": "function", "function": {"name": ...}} or '
        '{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}, '
        f"got {json.dumps(choice, default=str)[:100]}",
        param="tool_choice",
    )


def _allowed_tools(choice: dict[str, Any], tools: Sequence[ToolDefinition], parallel: bool) -> ToolChoice:
    """OpenAI's `{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [...]}}`;
    a tool is named as in chat's named choice (`{"type": "function", "function": {"name": ...}}`) or flat as
    the Responses API writes it (`{"type": "function", "name": ...}`)."""
    where = "tool_choice.allowed_tools"
    body = choice.get("allowed_tools")
    if not isinstance(body, dict):
        raise ToolError(f"{where} must be an object with 'mode' and 'tools'", param=where)
    mode = body.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise ToolError(f"{where}.mode must be 'auto' or 'required', got {mode!r}", param=f"{where}.mode")
    refs = body.get("tools")
    if not isinstance(refs, list) or not refs:
        raise ToolError(f"{where}.tools must be a non-empty list of tools", param=f"{where}.tools")
    known = [t.name for t in tools]
    names: list[str] = []
    for index, ref in enumerate(refs):
        ref = _plain(ref)
        name = None
        if isinstance(ref, dict) and ref.get("type", "function") == "function":
            name = ref.get("name", (ref.get("function") or {}).get("name"))
        if not isinstance(name, str):
            raise ToolError(
                f'{where}.tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}',
                param=f"{where}.tools",
            )
        if name not in known:
            raise ToolError(
                f"{where}.tools[{index}] names the function {name!r}, which is not among the tools "
                f"({', '.join(known)})",
                param=f"{where}.tools",
            )
        if name not in names:
            names.append(name)
    return ToolChoice(mode, parallel=parallel, allowed=tuple(names))


def _plain(value: Any) -> Any:
    if callable(getattr(value, "model_dump", None)):
        return value.model_dump(exclude_none=True)
    return value


def _tool(raw: Any, index: int) -> ToolDefinition:
    where = f"tools[{index}]"
    if not isinstance(raw, dict):
        raise ToolError(f"{where} must be an object, got {type(raw).__name__}")
    if raw.get("type", "function") != "function":
        raise ToolError(f"{where}.type must be 'function', got {raw.get('type')!r}")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function must be an object with a 'name'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function.name must be a non-empty string")
    if len(name) > _MAX_NAME_LENGTH or not set(name) <= _NAME_CHARS:
        raise ToolError(
            f"{where}: function name {name!r} must be 1-{_MAX_NAME_LENGTH} characters of a-z, A-Z, 0-9, _, - or ."
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where} ({name}): description must be a string")
    parameters = function.get("parameters")
    parameters = dict(_EMPTY_PARAMETERS) if parameters is None else parameters
    check_parameters(parameters, f"{where} ({name})")
    strict = raw.get("strict", function.get("strict", False))
    return ToolDefinition(name, parameters, description, bool(strict))


def check_parameters(parameters: Any, where: str) -> None:
    """A parameters schema must be a valid JSON Schema describing an object."""
    from jsonschema import SchemaError, validators

    if not isinstance(parameters, dict):
        raise ToolError(f"{where}: parameters must be a JSON Schema object, got {type(parameters).__name__}")
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ToolError(f"{where}: parameters must describe an object (type 'object'), got type {kind!r}")
    try:
        json.dumps(parameters, allow_nan=False)
        validators.validator_for(parameters).check_schema(parameters)
    except (TypeError, ValueError) as error:
        raise ToolError(f"{where}: parameters cannot be serialized as JSON: {error}") from None
    except SchemaError as error:
        path = "/".join(str(p) for p in error.absolute_path)
        raise ToolError(
            f"{where}: invalid parameters schema at #/{path}: {error.message}"
            if path
            else f"{where}: invalid parameters schema: {error.message}"
        ) from None
