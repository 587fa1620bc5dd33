"""Schema normalization: each exact rewrite keeps the set of valid instances (checked with jsonschema on
generated instances), and what cannot be rewritten exactly is left for relaxation."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from structgen.structured.normalize import detect_draft, normalize_schema
from structgen.structured.validate import validate_instance

KEYS = ["a", "b", "c", "kind", "x"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 6),
    st.sampled_from([1.5, 2.5, 3.0, 4.2, -0.5]),
    st.sampled_from(["", "a", "b", "start", "stop", "xyz"]),
)
instances = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)
    ),
    max_leaves=8,
)

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
EXACT_CASES: dict[str, dict[str, Any]] = {
    "draft4_bounds_and_dependencies": {
        "$schema": D4,
        "type": "object",
        "properties": {"a": {"type": "number", "maximum": 3, "exclusiveMaximum": True}},
        "dependencies": {"a": ["b"], "c": {"required": ["kind"]}},
    },
    "oneOf_by_type": {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "array"}]},
    "oneOf_by_discriminator": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "start"}, "a": {"type": "integer"}},
                "required": ["kind"],
            },
            {"type": "object", "properties": {"kind": {"enum": ["stop"]}}, "required": ["kind", "b"]},
        ]
    },
    "oneOf_by_range": {
        "oneOf": [{"type": "integer", "maximum": 2}, {"type": "number", "exclusiveMinimum": 2}]
    },
    "not_type": {"not": {"type": ["string", "null"]}},
    "not_required": {"type": "object", "not": {"required": ["a", "b"]}},
    "not_not": {"not": {"not": {"type": "array", "maxItems": 1}}},
    "not_anyOf": {"not": {"anyOf": [{"type": "string"}, {"required": ["a"]}]}},
    "if_then_else": {"if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {"required": ["c"]}},
    "items_array": {
        "$schema": D7,
        "type": "array",
        "items": [{"type": "integer"}, {"type": "string"}],
        "additionalItems": False,
    },
    "unevaluated": {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    "ref_siblings_draft7": {
        "$schema": D7,
        "definitions": {"n": {"type": "integer"}},
        "properties": {"a": {"$ref": "#/definitions/n", "type": "string"}},
    },
    "allOf_merge": {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "allOf_adjacent_kept": {"allOf": [{"properties": {"a": {}}}, {"additionalProperties": False}]},
    "integer_bounds": {"type": "integer", "minimum": 1.5, "exclusiveMaximum": 4.2},
    "dependentSchemas": {
        "dependentSchemas": {"a": {"properties": {"b": {"type": "string"}}, "required": ["b"]}}
    },
    "single_enum": {"type": "object", "properties": {"kind": {"enum": ["start"]}}},
    "unknown_format": {"type": "string", "format": "semver"},
}


@pytest.mark.parametrize("name", sorted(EXACT_CASES))
@settings(max_examples=80, deadline=None)
@given(instance=instances)
def test_exact_rewrites_keep_the_valid_set(name: str, instance: Any) -> None:
    schema = EXACT_CASES[name]
    normalized = normalize_schema(schema)
    assert all(c.kind == "rewrite" for c in normalized.changes)
    original = validate_instance(instance, schema).valid
    rewritten = jsonschema.Draft202012Validator(normalized.schema).is_valid(instance)
    assert original == rewritten, (normalized.schema, instance)


def test_rewrites_are_reported_and_drafts_detected() -> None:
    n = normalize_schema(EXACT_CASES["draft4_bounds_and_dependencies"])
    assert n.draft == "draft4" and n.serving_path == "rewritten"
    assert {c.keyword for c in n.changes} >= {"exclusiveMaximum", "dependencies"}
    assert "$schema" not in n.schema  # the output is 2020-12 whatever the input's draft
    assert normalize_schema(EXACT_CASES["oneOf_by_type"]).schema == {
        "anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "array"}]
    }
    assert normalize_schema(EXACT_CASES["allOf_merge"]).schema == {
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
    }
    assert "allOf" in normalize_schema(EXACT_CASES["allOf_adjacent_kept"]).schema
    assert detect_draft({"items": [{}]}) == "draft7"
    assert detect_draft({"exclusiveMinimum": True, "minimum": 1}) == "draft4"
    assert detect_draft({"type": "string"}) == "draft2020-12"


def test_annotations_are_dropped_silently() -> None:
    schema = {
        "title": "T",
        "description": "d",
        "examples": [1],
        "x-guidance": {"lenient": True},
        "type": "integer",
    }
    n = normalize_schema(schema)
    assert n.schema == {"type": "integer"} and n.serving_path == "exact"


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"type": "integer"}, {"minimum": 3}]},  # overlapping branches
        {"not": {"enum": ["a", "b"]}},
        {"type": "array", "uniqueItems": True},
        {"if": {"properties": {"kind": {"const": "x"}}}, "then": {"required": ["a"]}},
    ],
)
def test_what_cannot_be_rewritten_stays(schema: dict[str, Any]) -> None:
    n = normalize_schema(schema)
    assert n.serving_path == "exact" and n.schema == schema
