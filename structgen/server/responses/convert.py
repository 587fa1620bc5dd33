"""The one conversion layer between the Responses API and chat completions, request side.

A Responses request becomes a `ChatCompletionRequest` that the chat pipeline (`routes_chat.run_chat`) serves:
input items become chat messages (function calls assistant `tool_calls`, their outputs `role: "tool"`
messages, a reasoning item the `reasoning_content` of the assistant turn it precedes, which the chat template
keeps or drops as the model was trained: Qwen3's drops it from turns before the last user message),
`instructions` a system message first, the flat `text.format` / `tools` / `tool_choice` shapes
chat's nested ones, `max_output_tokens` `max_completion_tokens`. Errors the chat pipeline raises in chat's
terms are renamed back (`responses_error`), so a 400 names the field the client sent.

Input items are checked and normalized once (`input_items`) into the shape the API lists them in (ids,
`input_text` / `output_text` parts, `status`); output items already have that shape, so a stored
conversation is one list of items that `to_messages` turns into chat messages on every follow-up.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from structgen.server import protocol as p
from structgen.server.errors import APIError
from structgen.server.responses.protocol import ResponsesRequest, new_id

_ROLES = ("user", "assistant", "system", "developer")
# Content parts read as text: what a client writes, what the model wrote (an output message sent back).
_TEXT_PARTS = ("input_text", "output_text", "refusal")
_ITEM_TYPES = "message, function_call, function_call_output, reasoning"


def input_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as normalized items (a string is one user message); 400 naming the bad item."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not raw:
        raise APIError(400, "input must hold at least one item", param="input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(raw)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object, got {type(item).__name__}", param=where)
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise APIError(400, f"{where}.id must be a string", param=f"{where}.id")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
        return {
            "id": item.get("id") or new_id("fc"),
            "type": "function_call",
            "status": "completed",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
        }
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _joined(output, f"{where}.output", ("input_text",))
        return {
            "id": item.get("id") or new_id("fco"),
            "type": "function_call_output",
            "status": "completed",
            "call_id": _string(item, "call_id", where),
            "output": text,
        }
    if kind == "reasoning":
        return _reasoning(item, where)
    raise APIError(
        400,
        f"{where}: input items of type {kind!r} are not supported (supported: {_ITEM_TYPES})",
        param=f"{where}.type",
    )


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(
            400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role"
        )
    part_type = "output_text" if role == "assistant" else "input_text"
    content = item.get("content")
    text = content if isinstance(content, str) else _joined(content, f"{where}.content", _TEXT_PARTS)
    part: dict[str, Any] = {"type": part_type, "text": text}
    if part_type == "output_text":
        part["annotations"] = []
    return {
        "id": item.get("id") or new_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [part],
    }


def _reasoning(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A reasoning item sent back (an earlier output, as clients that keep their own context send it)."""
    if item.get("encrypted_content") is not None:
        raise APIError(
            400,
            f"{where}.encrypted_content: this server writes no encrypted reasoning and cannot read any; send the "
            "item's reasoning_text content instead, or leave the item out",
            param=f"{where}.encrypted_content",
        )
    return {
        "id": item.get("id") or new_id("rs"),
        "type": "reasoning",
        "summary": _parts(item.get("summary", []), f"{where}.summary", "summary_text"),
        "content": _parts(item.get("content") or [], f"{where}.content", "reasoning_text"),
        "status": "completed",
    }


def _parts(parts: Any, where: str, kind: str) -> list[dict[str, str]]:
    """A reasoning item's `summary` or `content`: `{"type": kind, "text": ...}` parts."""
    if not isinstance(parts, list):
        raise APIError(400, f"{where} must be a list of {kind} parts", param=where)
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{i}] must be a {kind} part with a text, got {got!r}", param=where)
    return [{"type": kind, "text": part["text"]} for part in parts]


def _joined(parts: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a list of content parts of `kinds` (a refusal's text is its `refusal`)."""
    if not isinstance(parts, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in kinds or not isinstance(part.get(key), str):
            raise APIError(
                400,
                f"{where}[{i}]: only text content parts are supported ({', '.join(kinds)}), got {kind!r}",
                param=f"{where}[{i}].type",
            )
        texts.append(part[key])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items → chat messages. Function calls join the assistant message before them (the text a model
    writes before its calls), so a turn renders as the model wrote it. A reasoning item opens an assistant turn:
    its text becomes that turn's `reasoning_content` (the template decides what the prompt keeps of it); one
    that no assistant output follows is dropped."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # the reasoning of the assistant turn about to start
    for item in items:
        if item["type"] == "reasoning":
            text = "".join(part["text"] for part in item["content"] or item["summary"])
            reasoning = text if reasoning is None else reasoning + text
            continue
        if item["type"] == "message":
            text = "".join(part.get("text", part.get("refusal", "")) for part in item["content"])
            messages.append({"role": item["role"], "content": text})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant" and reasoning is None:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:  # function_call_output
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


def chat_request(
    body: ResponsesRequest, *, context: list[dict[str, Any]], items: list[dict[str, Any]]
) -> p.ChatCompletionRequest:
    """The chat request serving `body`, continuing `context` (a stored conversation's items) with `items`."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += to_messages(context + items)
    text_format = body.text.format if body.text is not None else None
    chat: dict[str, Any] = {
        **body.model_dump(include=set(p.SamplingExtras.model_fields), exclude_defaults=True),
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "response_format": chat_response_format(text_format) if text_format is not None else None,
        "tools": chat_tools(body.tools) if body.tools is not None else None,
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "stream": body.stream,
        # The final usage chunk carries what `response.completed` reports.
        "stream_options": {"include_usage": True} if body.stream else None,
        "logprobs": body.wants_logprobs,
        "top_logprobs": body.top_logprobs if body.wants_logprobs else None,
        "thinking_token_budget": body.thinking_token_budget,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as error:  # every field was checked already; this would be a conversion bug
        raise APIError(
            400, f"cannot convert the request: {error.errors()[0]['msg']}", param="input"
        ) from None


def chat_response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """`text.format` (flat: `{"type": "json_schema", "name", "schema", "strict"}`) → chat's `response_format`."""
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise APIError(
            400,
            f"text.format.type must be text, json_object or json_schema, got {kind!r}",
            param="text.format.type",
        )
    if "schema" not in text_format:
        nested = (
            " (the Responses API takes it flat, not under 'json_schema')"
            if "json_schema" in text_format
            else ""
        )
        raise APIError(
            400, f"text.format.schema is required for json_schema{nested}", param="text.format.schema"
        )
    keys = ("name", "description", "schema", "strict")
    return {"type": "json_schema", "json_schema": {k: text_format[k] for k in keys if k in text_format}}


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat function tools → chat's `{"type": "function", "function": {...}}`, `strict` defaulting to true as
    the Responses API has it (chat's default is false)."""
    return [{"type": "function", "function": _function(tool, i)} for i, tool in enumerate(tools)]


def echo_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools as a Response reports them: flat, with `strict` resolved."""
    return [{"type": "function", **_function(tool, i)} for i, tool in enumerate(tools or ())]


def _function(tool: Any, index: int) -> dict[str, Any]:
    """A flat function tool's name, description, parameters and strict (true unless set); the rest of the checks
    (parameters schema, duplicate names) are the tool layer's, the same as chat's."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(400, f"{where}: only function tools are supported, got {kind!r}", param="tools")
    if "function" in tool and "name" not in tool:
        raise APIError(
            400,
            f'{where}: the Responses API takes function tools flat ({{"type": "function", "name": ..., '
            '"parameters": ...}), not nested under "function"',
            param="tools",
        )
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise APIError(400, f"{where}.name must be a non-empty string", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    strict = tool.get("strict")
    return {**function, "strict": True if strict is None else strict}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice`: the strings as they are; `{"type": "function", "name"}` and
    `{"type": "allowed_tools", "mode", "tools": [{"type": "function", "name"}]}` → chat's nested shapes."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):  # type: ignore[union-attr]
        return {"type": "function", "function": {"name": choice["name"]}}  # type: ignore[index]
    if kind == "allowed_tools":
        refs = choice.get("tools")  # type: ignore[union-attr]
        if not isinstance(refs, list):
            raise APIError(400, "tool_choice.tools must be a list of tools", param="tool_choice.tools")
        named = [{"type": "function", "function": {"name": _ref_name(ref, i)}} for i, ref in enumerate(refs)]
        mode = choice.get("mode", "auto")  # type: ignore[union-attr]
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": named}}
    raise APIError(
        400,
        "tool_choice must be 'none', 'auto', 'required', "
        '{"type": "function", "name": ...} or {"type": "allowed_tools", "mode": "auto" | "required", '
        f'"tools": [{{"type": "function", "name": ...}}]}}, got {json.dumps(choice, default=str)[:100]}',
        param="tool_choice",
    )


def _ref_name(ref: Any, index: int) -> Any:
    if not isinstance(ref, dict) or ref.get("type") != "function" or not isinstance(ref.get("name"), str):
        raise APIError(
            400,
            f'tool_choice.tools[{index}] must be {{"type": "function", "name": ...}} (only function tools '
            "are supported)",
            param="tool_choice.tools",
        )
    return ref["name"]


# Chat's field names → the Responses API's, in `param` and in messages.
_RENAMED = (
    ("tool_choice.allowed_tools", "tool_choice"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
)


def responses_error(error: APIError) -> APIError:
    """`error` (raised by the chat pipeline) in the Responses API's terms."""
    param, message = error.param, error.message
    if param is not None and (param == "messages" or param.startswith(("messages.", "messages["))):
        param = "input"  # message indexes shift (instructions, a stored conversation): name the field
    for chat, responses in _RENAMED:
        if param is not None and param.startswith(chat):
            param = responses + param[len(chat) :]
        message = message.replace(chat, responses)
    if (param, message) == (error.param, error.message):
        return error
    return APIError(error.status, message, param=param, code=error.code, headers=error.headers)
