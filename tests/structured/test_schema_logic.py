"""The two proofs behind exact rewrites: negation and disjointness, checked against jsonschema."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from test_normalize import instances

from structgen.structured.schema_logic import disjoint, negate

NEGATABLE = [
    True,
    False,
    {},
    {"type": "string"},
    {"type": ["number", "null"]},
    {"required": ["a", "b"]},
    {"not": {"type": "object"}},
    {"anyOf": [{"type": "string"}, {"required": ["kind"]}]},
    {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    {"type": "object", "required": ["a"]},
    {"properties": {"a": {"type": "string"}}},
]
DISJOINT = [
    ({"type": "string"}, {"type": "integer"}),
    ({"const": 1}, {"enum": [2, "1"]}),
    ({"enum": ["a", "b"]}, {"type": "number"}),
    ({"type": "integer", "maximum": 2}, {"type": "number", "exclusiveMinimum": 2}),
    (
        {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
        {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]},
    ),
    (
        {"type": "object", "required": ["a"]},
        {"type": "object", "properties": {"b": {}}, "additionalProperties": False},
    ),
    (False, {}),
]
OVERLAPPING = [
    ({"type": "integer"}, {"minimum": 3}),
    ({"type": "number"}, {"type": "integer"}),
    ({"const": 1}, {"const": 1.0}),
    (
        {"type": "object", "properties": {"kind": {"const": "a"}}},
        {"type": "object", "properties": {"kind": {"const": "b"}}},
    ),
    ({"type": "integer", "maximum": 2}, {"type": "number", "minimum": 2}),
]


@pytest.mark.parametrize("index", range(len(NEGATABLE)))
@settings(max_examples=60, deadline=None)
@given(instance=instances)
def test_negation_is_exact(index: int, instance: Any) -> None:
    schema = NEGATABLE[index]
    neg = negate(schema)
    assert neg is not None
    v = jsonschema.Draft202012Validator
    assert v(neg).is_valid(instance) == (not v(schema).is_valid(instance))


def test_negation_refuses_what_needs_not() -> None:
    assert negate({"enum": [1, 2]}) is None
    assert negate({"type": "integer"}) is None  # non-integer numbers have no type name
    assert negate({"pattern": "^a"}) is None


@pytest.mark.parametrize("pair", DISJOINT + OVERLAPPING, ids=lambda p: str(p)[:60])
@settings(max_examples=60, deadline=None)
@given(instance=instances)
def test_disjoint_is_sound(pair: tuple[Any, Any], instance: Any) -> None:
    a, b = pair
    if disjoint(a, b, {}):
        v = jsonschema.Draft202012Validator
        assert not (v(a).is_valid(instance) and v(b).is_valid(instance))


def test_disjoint_decisions() -> None:
    assert all(disjoint(a, b, {}) for a, b in DISJOINT)
    assert not any(disjoint(a, b, {}) for a, b in OVERLAPPING)
    root = {"$defs": {"s": {"type": "string"}}}
    assert disjoint({"$ref": "#/$defs/s"}, {"type": "boolean"}, root)
