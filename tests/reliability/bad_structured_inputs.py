"""The bad-input corpus's structured-output part: `response_format` and `structured_outputs` requests that must be
refused, each with the status it must get (spliced into `bad_input_corpus.CASES`)."""

from __future__ import annotations

import json
from typing import Any

from bad_input_constants import CHAT, JSON, MSG


def schema_body(schema: Any, **extra: Any) -> dict[str, Any]:
    return {
        "messages": MSG,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        **extra,
    }


def _deep_schema_body(depth: int) -> bytes:
    # Written out by hand: json.dumps (and so httpx) gives up before 1,000 levels.
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth
    head = json.dumps(schema_body("SCHEMA"))
    return head.replace('"SCHEMA"', schema).encode()


STRUCTURED_CASES: list[tuple[str, str, str, dict[str, Any], int]] = [
    (
        "response_format unknown type",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "response_format": {"type": "xml"}}},
        400,
    ),
    (
        "json_schema without schema",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}},
        400,
    ),
    ("schema not an object", "POST", CHAT, {"json": schema_body(42)}, 400),
    ("schema type unknown", "POST", CHAT, {"json": schema_body({"type": "banana"})}, 400),
    (
        "schema required not a list",
        "POST",
        CHAT,
        {"json": schema_body({"type": "object", "required": "a"})},
        400,
    ),
    ("schema unresolvable ref", "POST", CHAT, {"json": schema_body({"$ref": "#/$defs/missing"})}, 400),
    ("schema file ref", "POST", CHAT, {"json": schema_body({"$ref": "file:///etc/passwd"})}, 400),
    (
        "schema http ref",
        "POST",
        CHAT,
        {"json": schema_body({"$ref": "http://169.254.169.254/latest/meta-data"})},
        400,
    ),
    ("schema nested 1000 levels", "POST", CHAT, {"content": _deep_schema_body(1000), "headers": JSON}, 400),
    (
        "schema 10000 properties",
        "POST",
        CHAT,
        {
            "json": schema_body(
                {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
            )
        },
        400,
    ),
    (
        "schema enum 100000",
        "POST",
        CHAT,
        {"json": schema_body({"enum": [f"v{i}" for i in range(100_000)]})},
        400,
    ),
    (
        "schema unsatisfiable",
        "POST",
        CHAT,
        {"json": schema_body({"type": "string", "minLength": 5, "maxLength": 2})},
        400,
    ),
    (
        "schema invalid pattern",
        "POST",
        CHAT,
        {"json": schema_body({"type": "string", "pattern": "([a-z"})},
        400,
    ),
    ("guided_regex invalid", "POST", CHAT, {"json": {"messages": MSG, "guided_regex": "(unclosed"}}, 400),
    (
        "guided_regex catastrophic look-around",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "guided_regex": "(?=(a+)+)b"}},
        400,
    ),
    (
        "guided_grammar unparsable",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "guided_grammar": 'root ::= ( "a" | '}},
        400,
    ),
    (
        "guided_grammar lark garbage",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "guided_grammar": "start: ::: }}}"}},
        400,
    ),
    ("guided_choice empty", "POST", CHAT, {"json": {"messages": MSG, "guided_choice": []}}, 400),
    ("guided_choice not strings", "POST", CHAT, {"json": {"messages": MSG, "guided_choice": [1, 2]}}, 400),
    (
        "two structured kinds",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "guided_regex": "a+", "guided_choice": ["a"]}},
        400,
    ),
    (
        "structured_outputs wrong type",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "structured_outputs": "json"}},
        400,
    ),
    (
        "structured_outputs close_at_budget string",
        "POST",
        CHAT,
        {"json": schema_body({"type": "object"}, structured_outputs={"close_at_budget": "yes"})},
        400,
    ),
    (
        "structured_outputs loop_guard number",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "structured_outputs": {"json_object": True, "loop_guard": 1}}},
        400,
    ),
    (
        "structured_outputs options without a constraint",
        "POST",
        CHAT,
        {"json": {"messages": MSG, "structured_outputs": {"close_at_budget": False}}},
        400,
    ),
]
