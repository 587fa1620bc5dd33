"""The closing walk: from any point of a valid JSON output, the shortest completion it finds is accepted by the
grammar and makes an output that validates, on every backend (the budget closer that uses it:
`test_budget_closer.py`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from structured_helpers import compile_schema

from structgen.structured import StructuredBackend, StructuredOutputsParams, closing
from structgen.structured.closing import ByteTokens, can_end, shortest_completion
from structgen.structured.finishing import pattern_hints
from structgen.structured.json_scan import JsonScanner

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "age": {"type": "integer", "minimum": 18, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": "string", "format": "email"},
        "born": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
        "score": {"type": "number", "exclusiveMinimum": 0.5},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "maxLength": 5}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "note": {"type": "string"},
    },
    "required": ["name", "age", "role", "email", "born", "code", "score", "tags", "address"],
    "additionalProperties": False,
}
PERSON_OUTPUT = {
    "name": "Maria Lopez",
    "age": 34,
    "role": "user",
    "email": "maria@example.org",
    "born": "1990-04-12",
    "code": "ABC-123",
    "score": 7.25,
    "tags": ['a "quoted" tag', "b]}"],
    "address": {"city": "Lisbon", "zip": "1000"},
    "note": "done",
}
MATRIX = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
            "minItems": 1,
        },
        "ok": {"type": "boolean"},
        "nothing": {"type": "null"},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string", "minLength": 3}]},
    },
    "required": ["rows", "ok", "nothing", "either"],
}
MATRIX_OUTPUT = {"rows": [[1, 22], [333]], "ok": False, "nothing": None, "either": "abcd"}
CASES = [(PERSON, PERSON_OUTPUT), (MATRIX, MATRIX_OUTPUT), ({"type": "object"}, {"a": [1, {"b": "c"}]})]


@pytest.mark.parametrize("backend_name", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_prefix_closes_into_a_valid_output(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    tiny_tokenizer: Any,
    backend_name: str,
    case: int,
) -> None:
    schema, instance = CASES[case]
    grammar = compile_schema(backends[backend_name], schema)
    ids = encode(json.dumps(instance, separators=(",", ":"), ensure_ascii=False))
    # xgrammar's format grammars are looser than the formats (2023-02-31 passes): the engine's validation
    # flags such outputs; here its completions are held to everything else.
    formats = jsonschema.FormatChecker() if backend_name == "llguidance" else None
    checker = jsonschema.Draft202012Validator(schema, format_checker=formats)
    for cut in range(len(ids) + 1):
        grammar.reset()
        assert grammar.accept_tokens(ids[:cut])
        scanner = JsonScanner()
        scanner.feed(byte_tokens.text(ids[:cut]))
        plan = shortest_completion(grammar, byte_tokens, scanner)
        assert plan is not None, f"no completion after {tiny_tokenizer.decode(ids[:cut])!r}"
        text = tiny_tokenizer.decode(ids[:cut] + list(plan))
        assert grammar.accept_tokens(list(plan)), text
        assert can_end(grammar, byte_tokens.eos), text
        errors = [e.message for e in checker.iter_errors(json.loads(text))]
        assert not errors, f"{text}: {errors}"
        if cut == len(ids):
            assert plan == ()  # a complete output needs nothing more


def test_completion_is_short(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    """Closing an open string of an object with nothing else required costs a couple of tokens, not more."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}}
    grammar = compile_schema(backends["llguidance"], schema)
    prefix = '{"a":["one","two","thr'
    assert grammar.accept_tokens(encode(prefix))
    scanner = JsonScanner()
    scanner.feed(prefix.encode())
    plan = shortest_completion(grammar, byte_tokens, scanner)
    assert plan is not None and byte_tokens.text(list(plan)) == b'"]}'
    assert len(plan) <= 2


def test_walk_leaves_the_grammar_as_it_was(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    grammar = compile_schema(backends["llguidance"], PERSON)
    prefix = encode('{"name":"Jo')
    assert grammar.accept_tokens(prefix)
    scanner = JsonScanner()
    scanner.feed(byte_tokens.text(prefix))
    assert shortest_completion(grammar, byte_tokens, scanner) is not None
    assert grammar.validate_tokens(encode('hn","age":40')) == len(encode('hn","age":40'))
    assert not can_end(grammar, byte_tokens.eos)


def test_a_walk_through_repeated_records_chooses_as_before(
    backends: dict[str, StructuredBackend], byte_tokens: ByteTokens
) -> None:
    """The walk remembers a string's filler by what precedes it: 12 required records' enum value is chosen
    once for the first and once for the rest (by the bytes before them) and checked after; the completion is the one choosing each time gives (the first allowed letter,
    `b`, spelled out by the grammar)."""
    from structgen.structured import closing

    schema = {
        "type": "array",
        "minItems": 12,
        "items": {
            "type": "object",
            "properties": {"status": {"enum": ["todo", "blocked", "done"]}},
            "required": ["status"],
            "additionalProperties": False,
        },
    }
    grammar = compile_schema(backends["llguidance"], schema)
    calls = []
    original = closing._string_filler
    try:
        closing._string_filler = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore[assignment]
        plan = closing.shortest_completion(grammar, byte_tokens, JsonScanner())
    finally:
        closing._string_filler = original  # type: ignore[assignment]
    assert plan is not None
    assert byte_tokens.text(list(plan)) == b"[" + b",".join([b'{"status":"blocked"}'] * 12) + b"]"
    assert len(calls) == 2  # the first record (after `[`), then every other one (after `},`)


def test_forced_bytes_are_the_jump_forward_text(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    """llguidance reports forced bytes directly (the walk's fast path); they spell what jump-forward forces."""
    grammar = compile_schema(backends["llguidance"], PERSON)
    text = json.dumps(PERSON_OUTPUT, separators=(",", ":"), ensure_ascii=False)
    ids = encode(text)
    seen = 0
    for cut in range(len(ids)):
        grammar.reset()
        assert grammar.accept_tokens(ids[:cut])
        forced = grammar.forced_bytes()
        assert forced is not None
        tokens = grammar.find_jump_forward()
        assert forced.startswith(byte_tokens.text(tokens))  # the last token may be held back
        seen += bool(forced)
    assert seen > 5


def test_a_bounded_walk_takes_forced_bytes_up_to_its_depth(
    backends: dict[str, StructuredBackend],
    encode: Callable[[str], list[int]],
    byte_tokens: ByteTokens,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A walk that only closes the open record (`until_depth`) takes the key the grammar forces in one step,
    stops where the record closes (not at the forced `,` and `{` that follow), and leaves the grammar as it
    was; choosing the key's bytes one by one checked up to ~60 fillers a byte."""
    record = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "status": {"enum": ["open"]}},
        "required": ["id", "status"],
        "additionalProperties": False,
    }
    schema = {"type": "array", "items": record, "minItems": 3}
    grammar = compile_schema(backends["llguidance"], schema)
    prefix = encode('[{"id":12')
    assert grammar.accept_tokens(prefix)
    scanner = JsonScanner()
    scanner.feed(byte_tokens.text(prefix))
    checks: list[int] = []
    original = type(grammar).validate_tokens
    monkeypatch.setattr(type(grammar), "validate_tokens", lambda g, ids: checks.append(1) or original(g, ids))
    found = closing.walk(grammar, byte_tokens, scanner, until_depth=2)
    assert found is not None and found[1] == b',"status":"open"}'
    assert len(checks) < 10
    assert grammar.validate_tokens(encode(',"status":"open"}')) == len(encode(',"status":"open"}'))


def test_pattern_hints_are_parsed_once_per_spec() -> None:
    """Each request asks for its spec's hints; an equal spec (a new request with the same schema) reuses them."""
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^ZIP-[0-9]{5}$"}}}
    first = pattern_hints(StructuredOutputsParams(json=schema).to_spec())
    again = pattern_hints(StructuredOutputsParams(json=dict(schema)).to_spec())
    assert first == (b"ZIP-",)
    assert again is first


def test_a_pattern_that_needs_a_word_is_closed_with_it(
    backends: dict[str, StructuredBackend], encode: Callable[[str], list[int]], byte_tokens: ByteTokens
) -> None:
    """`"pattern": "date-time"` (a real GitHub schema): the string can only end once it holds that word, which
    no single filler reaches; the pattern's literal runs are offered to the walk as hints."""
    schema = {"type": "object", "properties": {"created": {"type": "string", "pattern": "date-time"}}}
    spec = StructuredOutputsParams(json=schema).to_spec()
    hints = pattern_hints(spec)
    assert hints == (b"date-time",)
    grammar = backends["llguidance"].compile(spec)
    prefix = encode('{"created":"2023-01-01T00:00:00Z, 2023-01-01')
    assert grammar.accept_tokens(prefix)
    scanner = JsonScanner()
    scanner.feed(byte_tokens.text(prefix))
    assert shortest_completion(grammar, byte_tokens, scanner) is None  # without the hint: no end found
    plan = shortest_completion(grammar, byte_tokens, scanner, hints=hints)
    assert plan is not None
    jsonschema.validate(json.loads(byte_tokens.text(prefix + list(plan)).decode()), schema)
