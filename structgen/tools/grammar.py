"""The grammar that enforces tool calls: a Lark grammar for llguidance with each function's arguments embedded
as a JSON Schema (`%json {...}`).

`required` / named: the output is exactly one block of calls (one call when `parallel_tool_calls` is false)
to the allowed functions, each call's arguments valid against that function's parameters schema.

`auto` is one grammar too, not an engine-level trigger: `start: TEXT | prefix calls`, where `prefix` is a
*lazy* rule (llguidance ends a lazy lexeme at the first point it can match) of free text followed by the
format's trigger (`<tool_call>`). Free text that never contains the trigger is accepted as is; the moment the
trigger is written, the lazy lexeme ends there and the rest must be a well-formed block of calls. Doing it
in the grammar keeps the engine unaware of tools, keeps jump-forward and the compile cache working, and
costs nothing while the model writes text (the text regex allows every token). xgrammar's structural tags
with triggers do the same, but would need a second code path for one backend; llguidance is the default.

Arguments schemas go through the same normalization as `response_format` schemas; a keyword llguidance
cannot enforce is relaxed (a superset is generated) and the parsed arguments are validated afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from structgen.tools.definitions import ToolChoice, ToolDefinition, ToolError
from structgen.tools.formats import ToolCallFormat

# Serialize arguments the way the format examples (and `json.dumps`) do: `{"a": 1, "b": 2}`.
_JSON_OPTIONS = {
    "key_separator": ": ",
    "item_separator": ", ",
    "whitespace_flexible": False,
    "coerce_one_of": False,
    "lenient": False,
}
_MAX_RELAX_STEPS = 32


@dataclass(frozen=True, slots=True)
class ArgumentsSchema:
    """What a function's arguments are generated under; `relaxed`: wider than `parameters`, so validate."""

    schema: dict[str, Any]
    relaxed: bool


def arguments_schema(tool: ToolDefinition) -> ArgumentsSchema:
    """The normalized (and where needed relaxed) schema the arguments of `tool` are generated under."""
    from structgen.structured.normalize import serving_path

    # OpenAI's strict mode promises arguments that match the schema exactly; a relaxed schema only validates
    # afterwards, so a strict tool the grammar cannot enforce is refused instead.
    strict = (
        f"function {tool.name!r} is strict, and its parameters schema cannot be enforced exactly ({{where}}); "
        "set strict to false to have it generated under a wider schema and validated afterwards"
    )
    schema, changes = _enforceable(
        tool.parameters,
        unsatisfiable=f"function {tool.name!r}: no arguments satisfy its parameters schema",
        unenforceable=f"function {tool.name!r}: the parameters schema cannot be enforced ({{where}})",
        exact=strict if tool.strict else None,
        param="tools",
    )
    if schema.get("type") != "object":  # arguments are always a JSON object
        schema = {**schema, "type": "object"}
    return ArgumentsSchema(schema, serving_path(tuple(changes)) == "relaxed")


@dataclass(frozen=True, slots=True)
class TextAnswer:
    """The JSON a text answer must be (`tool_choice="auto"` with a JSON response format): its schema and the
    llguidance JSON options (separators, whitespace) the response format asks for."""

    schema: dict[str, Any]
    options: dict[str, Any]


def answer_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The text answer's schema as the tool grammar embeds it: normalized, and enforced exactly (a schema that
    would need relaxing is refused: nothing would validate the answer afterwards)."""
    served, _ = _enforceable(
        schema,
        unsatisfiable="no answer satisfies the response format's schema",
        unenforceable="",
        exact="the response format's schema cannot be enforced exactly next to tool calls ({where})",
        param="response_format",
    )
    return served


def _enforceable(
    schema: Any, *, unsatisfiable: str, unenforceable: str, exact: str | None, param: str
) -> tuple[dict[str, Any], list[Any]]:
    """`schema` normalized, with what llguidance cannot enforce relaxed (`exact`: refused with that message
    instead), and the changes made. The messages take `{where}` (keyword, path and why)."""
    from structgen.structured.normalize import normalize_schema
    from structgen.structured.relax import relax
    from structgen.structured.support import LLGUIDANCE_SUPPORT

    normalized = normalize_schema(schema)
    if normalized.schema is False:
        raise ToolError(unsatisfiable, param=param)
    served: Any = {} if normalized.schema is True else normalized.schema
    changes = list(normalized.changes)
    for _ in range(_MAX_RELAX_STEPS):
        found = LLGUIDANCE_SUPPORT.find_unsupported(served)
        if not found:
            break
        where = f"{found[0].keyword} at {found[0].path}: {found[0].reason}"
        if exact is not None:
            raise ToolError(exact.format(where=where), param=param)
        widened, relaxed = relax(served, found)
        if widened == served:
            raise ToolError(unenforceable.format(where=where), param=param)
        served, changes = widened, changes + relaxed
    return served, changes


def tool_call_grammar(
    tools: Sequence[ToolDefinition],
    choice: ToolChoice,
    fmt: ToolCallFormat,
    *,
    answer: TextAnswer | None = None,
) -> str:
    """The Lark source constraining the output for `choice` (`auto`, `required` or `named`). `answer` (`auto`
    only): the JSON Schema a text answer follows; the output is then that JSON or a block of calls."""
    if choice.mode == "none":
        raise ValueError("tool_choice 'none' has no tool-call grammar")
    allowed = [t for t in tools if choice.permits(t.name)]
    if not allowed:
        raise ToolError("no tools to call", param="tool_choice")
    rules = ["%llguidance {}"]
    for i, tool in enumerate(allowed):
        schema = {**arguments_schema(tool).schema, "x-guidance": _JSON_OPTIONS}
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        rules.append(f"call_{i}: {_lit(fmt.call_head(tool.name))} args_{i} {_lit(fmt.call_tail())}")
        # The block's first call, written from just after the trigger.
        first_head = (fmt.begin + fmt.call_head(tool.name))[len(fmt.trigger) :]
        rules.append(f"first_{i}: {_seq(_lit(first_head), f'args_{i}', _lit(fmt.call_tail()))}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(allowed))))
    rules.append("first: " + " | ".join(f"first_{i}" for i in range(len(allowed))))
    more = f" ({_lit(fmt.separator)} call)*" if choice.parallel else ""
    rules.append(f"after_trigger: {_seq('first' + more, _lit(fmt.end))}")
    if choice.mode == "auto" and answer is not None:
        if fmt.trigger[:1] in ("{", "["):
            raise ToolError(
                f"this model writes tool calls as bare JSON ({fmt.name} format), so a JSON response format "
                "could not be told apart from a call: use tool_choice 'required' or 'none' with it",
                param="tool_choice",
            )
        # A JSON answer cannot start with the trigger (`<tool_call>`, `[TOOL_CALLS]`...): no text before calls.
        rules.append(f"start: answer | {_lit(fmt.trigger)} after_trigger")
        answer_rule = {**answer_json_schema(answer.schema), "x-guidance": answer.options}
        rules.append(f"answer: %json {json.dumps(answer_rule, ensure_ascii=False)}")
    elif choice.mode == "auto":
        rules.append("start: TEXT | prefix after_trigger")
        rules.append(f"prefix[lazy]: TEXT {_lit(fmt.trigger)}")
        rules.append(r"TEXT: /(.|\n)*/")
    else:
        rules.append(f"start: {_lit(fmt.trigger)} after_trigger")
    grammar = "\n".join(rules) + "\n"
    _check(grammar, allowed)
    return grammar


def _lit(text: str) -> str:
    # Lark string literals take JSON-style escapes; "" stands for nothing.
    return json.dumps(text, ensure_ascii=False) if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _check(grammar: str, tools: Sequence[ToolDefinition]) -> None:
    """Fail here, naming the function, if llguidance refuses an arguments schema."""
    try:
        import llguidance
    except ImportError:  # another backend will report what it refuses when it compiles
        return
    error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar))
    if not error:
        return
    for tool in tools:
        schema = {**arguments_schema(tool).schema, "x-guidance": _JSON_OPTIONS}
        own = llguidance.LLMatcher.validate_grammar(
            llguidance.grammar_from("json_schema", json.dumps(schema))
        )
        if own:
            raise ToolError(f"function {tool.name!r}: the parameters schema cannot be enforced: {own[:300]}")
    raise ToolError(f"the tool-call grammar does not compile: {error[:300]}")
