"""vLLM's own structured-output test specs: every schema, the regex, the SQL grammar (EBNF and Lark) and the
choices compile under `auto` and accept a valid output; the tool_choice=required outputs are accepted
exactly when vLLM says they should match."""

from __future__ import annotations

import json
from typing import Any

import pytest
from shared_data import VLLM_SAMPLES as SAMPLES
from structured_helpers import accepts_text

from structgen.structured import CompiledSpec, StructuredOutputsParams, compile_spec

AUTO = ("llguidance", "xgrammar", "outlines")

# A valid compact output for each schema file.
SCHEMA_OUTPUTS = {
    "benchmark_structured_schema_1.json": '[{"name":"Aria","race":"elf","class":"mage","level":3,"background":"sage","alignment":"good","backstory":"..."}]',
    "car_description.pydantic.schema.json": '{"brand":"Fiat","model":"500","car_type":"Coupe"}',
    "guidance_no_additional_properties.schema.json": '{"a1":"x","a2":"y","a3":"z"}',
    "min_max_length.schema.json": '{"description":"' + "d" * 50 + '"}',
    "reasoning_result.schema.json": '{"result":42}',
    "sample_complex_json_schema.json": '{"score":90,"grade":"A","email":"a@b.io","tags":["x","yz"]}',
    "sample_definition_json_schema.legacy.json": '{"steps":[{"explanation":"e","output":"o"}],"final_answer":"f"}',
    "sample_definition_json_schema.v1.json": '{"steps":[],"final_answer":"f"}',
    "sample_enum_json_schema.json": '{"status":"active","priority":"low","category":{"type":"bug","severity":2},"flags":["urgent"]}',
    "sample_json_schema.legacy.json": '{"name":"n","age":1,"skills":["a","b","c"],"work_history":[{"company":"c","position":"p"}]}',
    "sample_json_schema.v1.json": '{"name":"n","age":1,"skills":[],"grade":"B","email":"x@y.com","work_history":[]}',
    "unsupported_json_schema.xgrammar.json": '{"score":15,"tags":["abcdefghij"]}',
    "xgrammar_supported_schema.json": '{"name":"n","age":3,"email":"a@b.io"}',
}  # fmt: skip


def _compile(backends, params: StructuredOutputsParams) -> CompiledSpec:
    return compile_spec(params.to_spec(), [backends[n] for n in AUTO], time_limit_s=60)


@pytest.mark.parametrize("name", sorted(SCHEMA_OUTPUTS))
def test_sample_schemas(backends, encode, info, name: str) -> None:
    schema = json.loads((SAMPLES / name).read_text())
    compiled = _compile(backends, StructuredOutputsParams(json=schema))
    assert accepts_text(compiled.prototype, encode(SCHEMA_OUTPUTS[name]), info.eos_token_ids[0]), (
        compiled.backend
    )


def test_xgrammar_unsupported_list_is_served_without_loosening(backends, encode, info) -> None:
    groups = json.loads((SAMPLES / "xgrammar_unsupported_schemas.json").read_text())
    for schemas in groups.values():
        for schema in schemas:
            compiled = _compile(backends, StructuredOutputsParams(json=schema))
            # xgrammar would ignore these keywords: whoever serves them does so exactly or says it relaxed.
            assert compiled.backend != "xgrammar" or compiled.serving_path == "relaxed", schema
    multiple = _compile(backends, StructuredOutputsParams(json={"type": "integer", "multipleOf": 120}))
    assert multiple.serving_path == "exact"
    assert accepts_text(multiple.prototype, encode("240"), info.eos_token_ids[0])
    assert not accepts_text(multiple.prototype, encode("250"), info.eos_token_ids[0])


def test_sample_regex_grammars_and_choices(backends, encode, info) -> None:
    eos = info.eos_token_ids[0]
    ipv4 = _compile(
        backends, StructuredOutputsParams(regex=(SAMPLES / "sample_ipv4.regex").read_text().strip())
    )
    assert accepts_text(ipv4.prototype, encode("192.168.0.1"), eos)
    assert not accepts_text(ipv4.prototype, encode("256.1.1.1"), eos)
    for grammar_file in ("sample_sql.ebnf", "sample_sql.lark"):
        sql = _compile(backends, StructuredOutputsParams(grammar=(SAMPLES / grammar_file).read_text()))
        assert accepts_text(sql.prototype, encode("SELECTcol_2fromtable_2wherecol_1=2"), eos)
        assert not accepts_text(sql.prototype, encode("SELECTcol_2fromtable_3wherecol_1=2"), eos)
    choices = json.loads((SAMPLES / "sample_choices.json").read_text())
    compiled = _compile(backends, StructuredOutputsParams(choice=choices))
    assert all(accepts_text(compiled.prototype, encode(c), eos) for c in choices)
    assert not accepts_text(compiled.prototype, encode("Rust"), eos)


def _tools_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for tool_choice="required": a non-empty array of {name, parameters} calls."""
    calls = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"]["parameters"],
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}


def test_tool_choice_required_outputs(backends, encode, info) -> None:
    tools = json.loads((SAMPLES / "tools.tool_choice_required.json").read_text())
    compiled = _compile(backends, StructuredOutputsParams(json=_tools_schema(tools)))
    assert compiled.serving_path == "exact"
    cases = json.loads((SAMPLES / "tool_choice_required.outputs.json").read_text())
    for case in cases:
        text = json.dumps(case["output"], separators=(",", ":"), ensure_ascii=False)
        accepted = accepts_text(compiled.prototype, encode(text), info.eos_token_ids[0])
        assert accepted == case["should_match"], text
