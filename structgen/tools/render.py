"""The prompt side: tools, assistant `tool_calls` and `role: "tool"` results in the conversation.

A chat template that handles tools itself (it reads `tools` and messages' `tool_calls`, as Qwen's, Llama 3's
and Mistral's do) gets them as they are, with call arguments as objects (what those templates expect). For a
template without tool support (SmolLM2's ChatML) we write them into the conversation ourselves, the way
Qwen's template does: the tool list and the call format go into the system message, earlier calls into the
assistant's text in the model's format, and tool results into a user turn of `<tool_response>` blocks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from structgen.tools.definitions import ToolDefinition
from structgen.tools.formats import ToolCallFormat


def tools_system_text(tools: Sequence[ToolDefinition], fmt: ToolCallFormat) -> str:
    """The system-prompt section that lists the tools and shows the call format."""
    listing = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    example = fmt.render_block([("<function-name>", "<args-json-object>")])
    return (
        "# Tools\n\nYou may call one or more functions to help with the user's request. "
        f"The functions, as JSON signatures inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n\n"
        f"To call functions, reply with the name and arguments of each call, like this:\n{example}"
    )


def render_conversation(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[ToolDefinition],
    fmt: ToolCallFormat,
    *,
    template_supports_tools: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, `tools` for the template). `tools` is empty when the model must not see any."""
    if template_supports_tools:
        rendered = [_with_object_arguments(m) for m in messages]
        return rendered, [t.to_openai() for t in tools] or None
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            out.append({"role": "assistant", "content": _assistant_text(message, fmt)})
        elif role == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(message))
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        section = tools_system_text(tools, fmt)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else {}
        calls.append((str(function.get("name", "")), function.get("arguments", {})))
    return calls


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _assistant_text(message: dict[str, Any], fmt: ToolCallFormat) -> str:
    block = fmt.render_block([(name, _arguments_text(args)) for name, args in _calls(message)])
    content = _text(message.get("content"))
    return f"{content}\n{block}" if content.strip() else block


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """Call arguments as objects: OpenAI sends JSON strings, templates serialize what they get with `tojson`."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        call = dict(call)
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):  # else the template gets the string as sent
                function["arguments"] = json.loads(function["arguments"])
        call["function"] = function
        calls.append(call)
    return {**message, "tool_calls": calls}
