"""Reading corpora and reports, and the per-subset summary: no model involved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import write_jsonl

from structgen.validate import (
    CorpusError,
    SampleRecord,
    SchemaCase,
    SchemaRecord,
    load_corpus,
    read_report,
    render,
    stratified,
    summarize,
)
from structgen.validate.checks import GenerationOptions, build_prompt, judge, schema_problem


def test_jsonl_directory_and_single_file(tmp_path: Path) -> None:
    # A JSON string may hold U+2028: lines are split on "\n" only.
    write_jsonl(tmp_path / "a.jsonl", [{"schema": {"type": "string", "description": "x\u2028y"}}])
    (tmp_path / "loose.json").write_text(json.dumps({"type": "integer"}))
    cases = load_corpus(tmp_path)
    assert [(c.id, c.subset) for c in cases] == [("a:1", "a"), ("loose", tmp_path.name)]
    assert cases[0].schema["description"] == "x\u2028y"
    single = load_corpus(tmp_path / "loose.json")
    assert [(c.id, c.subset, c.schema) for c in single] == [("loose", "loose", {"type": "integer"})]


def test_corpus_errors_name_the_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "schema": {}}, {"id": "a", "schema": {}}])
    with pytest.raises(CorpusError, match="schema id 'a' appears twice"):
        load_corpus(path)
    write_jsonl(path, [{"schema": {}, "tests": [{"data": 1}]}])
    with pytest.raises(CorpusError, match=r"c\.jsonl:1: \"tests\" must be a list"):
        load_corpus(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"no \.json or \.jsonl files"):
        load_corpus(tmp_path / "empty")


def test_stratified_sample_is_evenly_spaced_and_nested() -> None:
    cases = [SchemaCase(f"{subset}{i}", subset, {}) for subset in "ab" for i in range(10)]
    assert [c.id for c in stratified(cases, 2)] == ["a0", "a5", "b0", "b5"]
    assert [c.id for c in stratified(cases, 3)] == ["a0", "a3", "a6", "b0", "b3", "b6"]
    # A larger sample contains the first schema of each subset, so --resume extends a per-subset-1 run.
    assert {c.id for c in stratified(cases, 1)} <= {c.id for c in stratified(cases, 4)}


def test_prompt_schema_check_and_verdicts() -> None:
    options = GenerationOptions(prompt_template="S={schema} {keep}", max_schema_chars=10)
    assert build_prompt(options, {"type": "string"}) == 'S={"type": " ... (truncated) {keep}'
    assert schema_problem({"type": "object"}) is None
    assert "minLength" in (schema_problem({"minLength": -1}) or "")
    assert schema_problem([1]) == "a JSON Schema must be an object or a boolean, got list"
    schema = {"type": "object", "required": ["a"]}
    assert judge("stop", '{"a": 1}', schema, None) == ("valid", None)
    status, error = judge("stop", "{}", schema, None)
    assert status == "invalid" and error is not None and error.startswith("required at /")
    assert judge("length", "{", schema, None) == ("truncated", None)
    assert judge("error", "", schema, "boom") == ("error", "boom")


def _records() -> tuple[list[SchemaRecord], list[SampleRecord]]:
    labels = {"valid": 2, "valid_accepted": 2, "invalid": 2, "invalid_accepted": 1}
    schemas = [
        SchemaRecord(
            "a", "s1", "compiled", backend="llguidance", path="exact", compile_s=0.002, labels=labels
        ),
        SchemaRecord("b", "s1", "unsupported", keyword="not"),
        SchemaRecord("c", "s2", "invalid_schema", error="bad"),
        SchemaRecord("d", "s2", "compiled", compile_s=0.004),
    ]
    samples = [
        SampleRecord("a", "s1", 0, "valid", "stop", "{}", 3, 1.0),
        SampleRecord("a", "s1", 1, "truncated", "length", "{", 8, 2.0),
        SampleRecord("d", "s2", 0, "invalid", "stop", "[]", 2, 1.0, error="type at /"),
    ]
    return schemas, samples


def test_summary_counts_and_formats() -> None:
    rows = {r.subset: r for r in summarize(*_records())}
    s1, total = rows["s1"], rows["all"]
    assert (s1.schemas, s1.compiled, s1.unsupported, s1.top_unsupported) == (2, 1, 1, [("not", 1)])
    assert (s1.valid, s1.truncated, s1.answered, s1.labels_agree, s1.labels_total) == (1, 1, 1, 3, 4)
    assert s1.tokens_per_s == pytest.approx(11 / 3)
    assert (total.schemas, total.invalid_schema, total.invalid, total.compile_p50_ms) == (4, 1, 1, 4.0)
    markdown = render(list(rows.values()), "markdown", footer=["note"]).splitlines()
    assert markdown[0].startswith("| subset | schemas | compiled |") and markdown[-1] == "note"
    assert markdown[2].startswith(
        "| s1 | 2 | 1 (50.0%) | 1 | 0 | 0 | 1 | 0 | 1 | 0 | 1 (50.0%) | 100.0% | 3 (75.0%) |"
    )
    table = render(list(rows.values()), "table").splitlines()
    assert table[0].split()[:3] == ["subset", "schemas", "compiled"] and len(table) == 4
    data = json.loads(render(list(rows.values()), "json"))
    assert data["subsets"][2]["subset"] == "all" and data["subsets"][2]["invalid"] == 1


def test_report_round_trip_drops_unfinished_schemas(tmp_path: Path) -> None:
    schemas, samples = _records()
    lines = [s.to_json() for s in samples] + [s.to_json() for s in schemas if s.id != "d"]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + '\n{"kind": "sche')  # a run killed mid-line, before d's schema line
    got_schemas, got_samples = read_report(path)
    assert got_schemas == schemas[:3]
    assert got_samples == samples[:2]
    path.write_text('{"kind": 1}\n' + "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:1: not a validate report line"):
        read_report(path)
