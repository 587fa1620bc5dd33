"""The `auto` policy: fallback between backends, explicit relaxation instead of silent loosening, and clear
errors naming the keyword and JSON path when nothing can serve a schema."""

from __future__ import annotations

from typing import Any

import pytest
from structured_helpers import accepts_text

from structgen.structured import CompiledSpec, StructuredOutputsParams, UnsupportedSchemaError, compile_spec
from structgen.structured.relax import relax
from structgen.structured.support import Unsupported

AUTO = ("llguidance", "xgrammar", "outlines")


def _compile(backends, schema: Any, names=AUTO) -> CompiledSpec:
    return compile_spec(StructuredOutputsParams(json=schema).to_spec(), [backends[n] for n in names])


def test_schema_a_backend_fails_to_compile_is_served_by_the_next(backends, encode, info) -> None:
    # xgrammar's compiler rejects a `false` subschema (passes its keyword check, fails in compile).
    schema = {"type": "object", "properties": {"a": False, "b": {"type": "integer"}}}
    assert not backends["xgrammar"].find_unsupported(schema)
    compiled = _compile(backends, schema, names=("xgrammar", "llguidance"))
    assert compiled.backend == "llguidance" and compiled.serving_path == "exact"
    assert any(r.startswith("[xgrammar]") and "false" in r for r in compiled.refusals)
    eos = info.eos_token_ids[0]
    assert accepts_text(compiled.prototype, encode('{"b":1}'), eos)
    assert not accepts_text(compiled.prototype, encode('{"a":1}'), eos)


def test_format_only_xgrammar_enforces_goes_to_xgrammar(backends) -> None:
    compiled = _compile(backends, {"type": "string", "format": "json-pointer"})
    assert (compiled.backend, compiled.serving_path) == ("xgrammar", "exact")


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),  # length next to a pattern
        ({"oneOf": [{"type": "integer"}, {"minimum": 3}]}, "oneOf"),  # would become anyOf semantics
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "minimum": 3}, "$ref"),
    ],
)
def test_a_backend_that_would_ignore_a_keyword_is_not_chosen_for_it(
    backends, schema: dict, keyword: str
) -> None:
    assert backends["xgrammar"].find_unsupported(schema)[0].keyword == keyword
    with pytest.raises(UnsupportedSchemaError) as err:
        backends["xgrammar"].compile(StructuredOutputsParams(json=schema).to_spec())
    assert err.value.keyword == keyword and err.value.path == "#"
    # Served by xgrammar alone only under an explicit, validated relaxation; never as "exact".
    only = _compile(backends, schema, names=("xgrammar",))
    assert only.serving_path == "relaxed" and only.needs_validation
    assert any(c.kind == "relax" and c.keyword == keyword for c in only.changes)


def test_relaxed_grammar_is_a_superset_and_names_what_it_dropped(backends, encode, info) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    compiled = _compile(backends, schema)
    assert compiled.backend == "llguidance" and compiled.serving_path == "relaxed"
    assert [(c.keyword, c.path, c.kind) for c in compiled.changes] == [("uniqueItems", "#", "relax")]
    eos = info.eos_token_ids[0]
    assert accepts_text(compiled.prototype, encode("[1,2]"), eos)
    assert accepts_text(compiled.prototype, encode("[1,1]"), eos)  # validation catches this one
    assert not accepts_text(compiled.prototype, encode("[1,2,3,4]"), eos)  # the rest is still enforced


def test_rewritten_path_is_reported(backends) -> None:
    compiled = _compile(backends, {"oneOf": [{"type": "string"}, {"type": "integer"}]})
    assert compiled.serving_path == "rewritten" and not compiled.needs_validation
    assert compiled.changes[0].keyword == "oneOf" and compiled.changes[0].kind == "rewrite"


@pytest.mark.parametrize(
    ("schema", "keyword", "path"),
    [
        # No backend reads the backreference, and Python's re (which validation uses) cannot either.
        ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?<a>x)\\k<a>$"}}}, "pattern", "#/properties/code"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref", "#/properties/a"),
    ],
)  # fmt: skip
def test_schema_none_can_enforce_names_keyword_and_path(
    backends, schema: dict, keyword: str, path: str
) -> None:
    with pytest.raises(UnsupportedSchemaError) as err:
        _compile(backends, schema)
    assert err.value.keyword == keyword and err.value.path == path
    assert f"keyword {keyword!r} at {path}" in str(err.value)


def test_unsatisfiable_schema_is_refused_plainly(backends) -> None:
    schema = {"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}
    with pytest.raises(UnsupportedSchemaError, match="no JSON value satisfies") as err:
        _compile(backends, schema)
    assert err.value.path == "#"


def test_all_of_branch_beside_other_assertions_is_not_left_to_xgrammar(backends) -> None:
    # Normalization leaves a branch it cannot merge beside the node's own keywords; xgrammar would not
    # intersect them, so it refuses and `auto` serves the schema with llguidance.
    schema = {"type": "integer", "minimum": 0, "allOf": [{"minimum": 5}]}
    assert [u.keyword for u in backends["xgrammar"].find_unsupported(schema)] == ["allOf"]
    with pytest.raises(UnsupportedSchemaError) as err:
        _compile(backends, schema, names=("xgrammar",))
    assert err.value.keyword == "allOf" and err.value.path == "#"
    compiled = _compile(backends, schema)
    assert (compiled.backend, compiled.serving_path) == ("llguidance", "exact")


def test_contradictory_all_of_is_never_served_as_exact(backends) -> None:
    # Normalization folds the first branch into the node; xgrammar used to take the rest as "exact" and emit
    # integers for a schema that no value satisfies.
    schema = {"allOf": [{"type": "string"}, {"type": "integer"}]}
    try:
        compiled = _compile(backends, schema)
    except UnsupportedSchemaError:
        return
    assert compiled.serving_path == "relaxed" and compiled.needs_validation


def test_non_json_kinds_fall_back_by_kind(backends) -> None:
    spec = StructuredOutputsParams(grammar='root ::= "a" | "b"').to_spec()
    assert compile_spec(spec, [backends["outlines"], backends["xgrammar"]]).backend == "xgrammar"
    with pytest.raises(UnsupportedSchemaError, match="grammar"):
        compile_spec(spec, [backends["outlines"]])


def test_relax_widens_only_the_reported_spots() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"oneOf": [{"type": "integer"}, {"minimum": 0}]},
            "b": {"oneOf": [{"type": "integer"}, {"minimum": 0}]},
            "m": {
                "type": "object",
                "patternProperties": {"^x": {"type": "integer"}},
                "additionalProperties": False,
            },
            "c": {"if": {"required": ["k"]}, "then": {"required": ["v"]}, "else": {"required": ["w"]}},
        },
    }
    found = [
        Unsupported("oneOf", "#/properties/a", "r"),
        Unsupported("patternProperties", "#/properties/m", "r"),
        Unsupported("if", "#/properties/c", "r"),
    ]
    relaxed, changes = relax(schema, found)
    props = relaxed["properties"]
    assert props["a"] == {"anyOf": [{"type": "integer"}, {"minimum": 0}]}
    assert props["b"] == schema["properties"]["b"]
    assert props["m"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["c"] == {
        "allOf": [{"anyOf": [{"allOf": [{"required": ["k"]}, {"required": ["v"]}]}, {"required": ["w"]}]}]
    }
    assert [c.path for c in changes] == ["#/properties/a", "#/properties/m", "#/properties/c"]
