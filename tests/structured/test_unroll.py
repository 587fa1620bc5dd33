"""Recursive schemas on the `restricted` path: reference cycles unrolled to a depth, every random-walk output of
the grammar valid under the original schema, the depth limit reported and configurable."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
from test_schema_fuzz import check_schema

from structgen.structured import StructuredOutputManager, StructuredOutputsParams, TokenizerInfo
from structgen.structured.manager import StructuredOutputConfig
from structgen.structured.unroll import _cyclic, _reference_graph, unroll_cycles

# A cycle through a `$ref` with sibling keywords: llguidance refuses it as is.
SIBLING_CYCLE: dict[str, Any] = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "next": {"$ref": "#/$defs/node", "type": "object", "required": ["v"]},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
# Through an `anyOf` of references next to a `type`, in array items (the shape of the WashingtonPost ANS
# schemas in JSONSchemaBench's Handwritten set).
ANYOF_ITEMS_CYCLE: dict[str, Any] = {
    "definitions": {
        "content": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["text", "image"]},
                "children": {
                    "type": "array",
                    "items": {
                        "anyOf": [{"$ref": "#/definitions/content"}, {"$ref": "#/definitions/leaf"}],
                        "type": "object",
                    },
                    "maxItems": 3,
                },
            },
            "required": ["kind"],
            "additionalProperties": False,
        },
        "leaf": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 8}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
    "$ref": "#/definitions/content",
}
# Through `additionalProperties`, with the root itself recursing ("#").
ROOT_MAP_CYCLE: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"$ref": "#", "description": "a nested map", "maxProperties": 2},
    "maxProperties": 2,
}


@pytest.fixture(scope="module")
def manager(info: TokenizerInfo) -> StructuredOutputManager:
    return StructuredOutputManager(info, StructuredOutputConfig(compile_timeout_s=20.0))


def _has_cycle(schema: Any) -> bool:
    graph = _reference_graph(schema)
    assert graph is not None
    return bool(_cyclic(graph))


@pytest.mark.parametrize("schema", [SIBLING_CYCLE, ANYOF_ITEMS_CYCLE, ROOT_MAP_CYCLE])
def test_unrolling_leaves_no_cycle_and_only_narrows(schema: dict[str, Any]) -> None:
    unrolled, changes = unroll_cycles(schema, depth=3)  # type: ignore[misc]
    assert _has_cycle(schema) and not _has_cycle(unrolled)
    assert changes and all(c.kind == "restrict" and "depth 3" in c.note for c in changes)
    original = jsonschema.Draft202012Validator(schema)
    narrowed = jsonschema.Draft202012Validator(unrolled)
    deep: Any = {"v": 1}
    for i in range(6):  # nesting 1..6 deep: the unrolled schema takes the first levels, the original all
        if schema is SIBLING_CYCLE:
            instance, deep = deep, {"v": i, "next": deep}
            assert original.is_valid(instance)
            assert narrowed.is_valid(instance) == (i < 3)
    for instance in (
        {"kind": "text"},
        {"kind": "image", "children": [{"text": "a"}, {"kind": "text"}]},
        {"a": {}},
    ):
        if narrowed.is_valid(instance):
            assert original.is_valid(instance)


def test_nothing_to_unroll_without_a_cycle_or_with_pointers_it_does_not_follow() -> None:
    assert unroll_cycles({"type": "object", "$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"}) is None
    assert unroll_cycles({"properties": {"a": {"$ref": "#/properties/a"}}}) is None  # not a definition
    with pytest.raises(ValueError, match="depth must be >= 1"):
        unroll_cycles(SIBLING_CYCLE, depth=0)


def test_a_cycle_under_oneof_or_not_is_validated_not_restricted() -> None:
    schema = {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {"c": {"oneOf": [{"$ref": "#/$defs/n"}, {"type": "object"}]}},
            }
        },
        "$ref": "#/$defs/n",
    }
    _, changes = unroll_cycles(schema, depth=2)  # type: ignore[misc]
    assert changes and all(c.kind == "relax" and "validated" in c.note for c in changes)


@pytest.mark.parametrize("schema", [SIBLING_CYCLE, ANYOF_ITEMS_CYCLE, ROOT_MAP_CYCLE])
def test_recursive_schemas_are_served_and_every_walk_validates(
    schema: dict[str, Any], manager: StructuredOutputManager
) -> None:
    compiled = manager.compile(StructuredOutputsParams(json=schema).to_spec())
    assert compiled.serving_path in ("exact", "rewritten", "restricted")
    ended = sum(check_schema(schema, manager, random.Random(seed)) for seed in range(3))
    assert ended > 0


def test_a_sibling_cycle_takes_the_restricted_path_and_reports_its_depth(
    manager: StructuredOutputManager, info: TokenizerInfo
) -> None:
    compiled = manager.compile(StructuredOutputsParams(json=SIBLING_CYCLE).to_spec())
    assert compiled.serving_path == "restricted"
    assert any("unrolled to depth 4" in c.note for c in compiled.changes)
    shallow = StructuredOutputManager(info, StructuredOutputConfig(recursion_depth=2))
    assert any(
        "depth 2" in c.note
        for c in shallow.compile(StructuredOutputsParams(json=SIBLING_CYCLE).to_spec()).changes
    )


def test_recursion_depth_zero_refuses_what_no_backend_takes(info: TokenizerInfo) -> None:
    off = StructuredOutputManager(info, StructuredOutputConfig(recursion_depth=0))
    compiled = off.compile(StructuredOutputsParams(json=SIBLING_CYCLE).to_spec())
    assert (
        compiled.serving_path == "relaxed"
    )  # the siblings of the circular $ref dropped and validated instead
    with pytest.raises(ValueError, match="recursion_depth"):
        StructuredOutputConfig(recursion_depth=-1)


def test_an_unrolled_schema_is_plain_json() -> None:
    unrolled, _ = unroll_cycles(ANYOF_ITEMS_CYCLE, depth=2)  # type: ignore[misc]
    assert json.loads(json.dumps(unrolled)) == unrolled
    assert "content__depth1" in unrolled["definitions"]


def test_the_structured_report_names_the_path_and_the_depth(manager: StructuredOutputManager) -> None:
    from structgen.structured.request import StructuredRequest

    req = StructuredRequest(manager, StructuredOutputsParams(json=SIBLING_CYCLE))
    req.future.result(timeout=60)
    req.start()
    report = req.report()
    assert report["path"] == "restricted"
    assert any(c.startswith("restrict $ref at #/$defs/node") and "depth 4" in c for c in report["changes"])
    assert not req.holds_back_output  # a restriction needs no retries: its outputs stream as they come
