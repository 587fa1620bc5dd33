"""Jinja chat templates, rendered the way Hugging Face transformers renders them.

Same environment as `transformers.utils.chat_template_utils` (sandboxed, `trim_blocks`/`lstrip_blocks`,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape and takes `indent`,
`separators`, `sort_keys`, `ensure_ascii`), same variables (`messages`, `tools`, `documents`,
`add_generation_prompt`, the named special tokens, extra keyword arguments), same message clean-up (keys whose
value is None dropped, reasoning fields aliased), so a prompt renders to the same text here and there.

One deliberate difference: OpenAI clients send `content` as a list of `{"type": "text", "text": ...}` parts.
A template that never iterates over `content` (most text-only templates) would print that list's repr, so for
such templates the text parts are joined with newlines first (vLLM does the same).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from structgen.errors import StructgenError

ContentFormat = Literal["string", "openai"]

# Message fields that carry a model's reasoning; templates read `reasoning_content` (gpt-oss reads `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


class ChatTemplateError(StructgenError, ValueError):
    """The chat template is missing or invalid, rejected the conversation, or the messages are malformed."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; rendering ignores it."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<>&'`; chat templates expect plain json.dumps (as transformers gives).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def _compile(source: str) -> tuple[jinja2.Template, ContentFormat]:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        ast = env.parse(source)
        template = env.from_string(ast)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc
    return template, _detect_content_format(ast)


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


def _detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """'openai' when the template loops over a message's `content` (it understands lists of parts)."""
    content_vars: set[str] = set()
    for assign in ast.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _is_content_access(assign.node):
            content_vars.add(assign.target.name)
    for loop in ast.find_all(jinja2.nodes.For):
        source = loop.iter
        if _is_content_access(source):
            return "openai"
        while isinstance(source, jinja2.nodes.Filter) and source.node is not None:
            source = source.node
        if isinstance(source, jinja2.nodes.Name) and source.name in content_vars:
            return "openai"
    return "string"


def _plain(value: Any, where: str) -> Any:
    """A deep copy made of plain JSON-like types, so templates never see (or mutate) caller objects."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. the OpenAI SDK's message types
        return _plain(value.model_dump(), where)
    raise ChatTemplateError(f"{where} has a value of type {type(value).__name__}; expected JSON-like data")


def _join_text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise ChatTemplateError(
                f"{where}[{i}] is a {kind or type(part).__name__!s} content part; this model takes text parts only"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: Iterable[Any], content_format: ContentFormat) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Iterable):
        raise ChatTemplateError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    normalized = []
    for index, raw in enumerate(messages):
        where = f"messages[{index}]"
        message = _plain(raw, where)
        if not isinstance(message, dict):
            raise ChatTemplateError(
                f"{where} must be a dict with 'role' and 'content', got {type(raw).__name__}"
            )
        message = {key: value for key, value in message.items() if value is not None}
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"{where} has no string 'role'")
        content = message.get("content")
        if isinstance(content, list) and content_format == "string":
            message["content"] = _join_text_parts(content, f"{where}.content")
        elif content is not None and not isinstance(content, str | list):
            raise ChatTemplateError(f"{where}.content must be a string or a list of parts")
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


class ChatTemplate:
    """One compiled chat template. Compilation is cached per template text."""

    __slots__ = ("_template", "content_format", "source")

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source:
            raise ChatTemplateError("chat template must be a non-empty string")
        self.source = source
        self._template, self.content_format = _compile(source)

    def render(
        self,
        messages: Iterable[Any],
        *,
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **template_kwargs: Any,
    ) -> str:
        if tools is not None and not isinstance(tools, list | tuple):
            raise ChatTemplateError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
        variables = {**(special_tokens or {}), **_plain(template_kwargs, "template_kwargs")}
        try:
            return self._template.render(
                messages=normalize_messages(messages, self.content_format),
                tools=_plain(tools, "tools"),
                documents=_plain(documents, "documents"),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc


def select_template(templates: Mapping[str, str], *, name: str | None, tools: list[Any] | None) -> str:
    """Pick from named templates like transformers: an explicit name, else 'tool_use' with tools, else 'default'."""
    if name is not None:
        if name not in templates:
            raise ChatTemplateError(
                f"no chat template named {name!r}; this tokenizer has {sorted(templates)}"
            )
        return templates[name]
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if not templates:
        raise ChatTemplateError(
            "this tokenizer has no chat template (none in tokenizer_config.json or chat_template.jinja)"
        )
    raise ChatTemplateError(
        f"this tokenizer has several chat templates and none is 'default': {sorted(templates)}"
    )
