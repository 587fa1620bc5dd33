"""Request → canonical spec, and the errors for malformed requests."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from structgen.structured import InvalidSpecError, StructuredOutputsParams


def test_each_kind_canonicalizes() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    s = StructuredOutputsParams(json=schema).to_spec()
    assert (
        s.kind == "json_schema"
        and s.text == '{"type":"object","properties":{"b":{"type":"string"},"a":{"type":"integer"}}}'
    )
    assert StructuredOutputsParams(json=json.dumps(schema, indent=2)).to_spec() == s  # text or dict: same key
    assert StructuredOutputsParams(json_object=True).to_spec().schema() == {"type": "object"}
    assert StructuredOutputsParams(regex=r"\d+").to_spec().text == r"\d+"
    choice = StructuredOutputsParams(choice=["a", "b", "a"]).to_spec()
    assert choice.choices() == ["a", "b"]
    assert StructuredOutputsParams(grammar='root ::= "x"').to_spec().syntax == "ebnf"
    assert StructuredOutputsParams(grammar='start: "x"').to_spec().syntax == "lark"


def test_options_are_part_of_the_key_and_property_order_is_kept() -> None:
    compact = StructuredOutputsParams(json={"type": "object"}).to_spec()
    flexible = StructuredOutputsParams(json={"type": "object"}, whitespace="flexible").to_spec()
    assert compact.key != flexible.key
    reordered = StructuredOutputsParams(json={"properties": {"a": {}, "b": {}}}).to_spec()
    assert reordered.key != StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}}).to_spec().key
    strict = StructuredOutputsParams(json={"type": "object"}, strict=True).to_spec()
    assert strict.key == compact.key  # strictness decides what happens after validation, not the grammar


def test_pydantic_model_and_response_format() -> None:
    class Person(BaseModel):
        name: str
        age: int

    spec = StructuredOutputsParams(json=Person).to_spec()
    assert spec.schema()["required"] == ["name", "age"]
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "p", "strict": True, "schema": Person.model_json_schema()},
    }
    params = StructuredOutputsParams.from_response_format(rf)
    assert params is not None and params.strict and params.to_spec() == spec
    assert StructuredOutputsParams.from_response_format({"type": "text"}) is None
    assert StructuredOutputsParams.from_response_format({"type": "json_object"}).json_object  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "got none"),
        ({"json": {}, "regex": "a"}, "got json, regex"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1, 2]}, "object or a boolean"),
        ({"regex": ""}, "non-empty string"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 3]}, "non-empty list"),
        ({"grammar": "   "}, "non-empty Lark"),
        ({"json": {}, "whitespace": "pretty"}, "whitespace must be"),
        ({"json": {}, "max_whitespace": 0}, "max_whitespace"),
        ({"json": {"const": float("nan")}}, "cannot be serialized"),
    ],
)
def test_malformed_requests_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        StructuredOutputsParams(**kwargs)


def test_bad_response_format() -> None:
    with pytest.raises(InvalidSpecError, match=r"response_format\.type"):
        StructuredOutputsParams.from_response_format({"type": "xml"})
    with pytest.raises(InvalidSpecError, match="must be an object with a 'schema'"):
        StructuredOutputsParams.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
