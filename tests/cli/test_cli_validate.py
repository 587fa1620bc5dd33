"""`structgen validate` as a subprocess: counts, exit codes and report lines on a hand-made corpus and on
samples of JSONSchemaBench (tiny for the mechanics, SmolLM2 where outputs must finish and validate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import report_lines, structgen, write_jsonl
from shared_data import JSONSCHEMABENCH

from structgen.cli import main

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CORPUS = [
    {
        "id": "person",
        "schema": PERSON,
        "tests": [
            {"data": {"name": "Ann", "age": 3}, "valid": True},
            {"data": {"name": "Ann"}, "valid": False},
            {"data": {"name": "Ann", "age": 3, "x": 1}, "valid": False},
        ],
    },
    {"id": "bad-type", "schema": {"type": "object", "properties": {"x": {"type": "wrong"}}}},
    # A remote $ref: no backend can resolve it offline.
    {"id": "remote-ref", "subset": "other", "schema": {"$ref": "http://example.com/schema.json"}},
]


def test_small_corpus_counts_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_jsonl(tmp_path / "mini.jsonl", CORPUS)
    report = tmp_path / "report.jsonl"
    # llguidance alone: building the fallback backends for a 100k vocabulary takes long on a shared CPU.
    args = ["validate", "--schemas", corpus, "--model", "tiny", "--backend", "llguidance"]
    args += ["--max-tokens", "4", "--samples", "2"]
    result = structgen(*args, "--report", report, "--format", "json", "--no-progress")
    assert result.returncode == 0, result.stderr  # tiny never finishes an output: nothing fails validation
    schemas, samples = report_lines(report)
    assert {k: v["status"] for k, v in schemas.items()} == {
        "person": "compiled",
        "bad-type": "invalid_schema",
        "remote-ref": "unsupported",
    }
    assert schemas["person"]["labels"] == {
        "valid": 1,
        "valid_accepted": 1,
        "invalid": 2,
        "invalid_accepted": 0,
    }
    assert schemas["person"]["backend"] == "llguidance" and schemas["person"]["compile_s"] > 0
    assert "properties/x/type" in schemas["bad-type"]["error"]
    assert schemas["remote-ref"]["keyword"] == "$ref"
    assert [(s["id"], s["index"], s["status"], s["tokens"]) for s in samples] == [
        ("person", 0, "truncated", 4),
        ("person", 1, "truncated", 4),
    ]
    summary = {row["subset"]: row for row in json.loads(result.stdout)["subsets"]}
    assert summary["mini"]["schemas"] == 2 and summary["mini"]["invalid_schema"] == 1
    assert summary["mini"]["compiled"] == 1 and summary["mini"]["truncated"] == 2
    assert (summary["mini"]["labels_agree"], summary["mini"]["labels_total"]) == (3, 3)
    assert summary["other"]["unsupported"] == 1 and summary["other"]["top_unsupported"] == [["$ref", 1]]
    assert summary["all"]["schemas"] == 3 and summary["all"]["samples"] == 2

    # Resume: every schema is in the report, so nothing runs (no model loads) and the summary is the same.
    resume = ["validate", "--schemas", str(corpus), "--report", str(report), "--resume"]
    assert main([*resume, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert "resuming: 3 schemas finished" in err
    assert json.loads(out)["subsets"] == json.loads(result.stdout)["subsets"]

    # An invalid finished output anywhere in the run makes the exit code 1.
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    sample = next(r for r in rows if r["kind"] == "sample")
    sample.update(status="invalid", finish_reason="stop", text="{}", error="required at /: 'name'")
    report.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([*resume, "--format", "json"]) == 1
    assert json.loads(capsys.readouterr().out)["subsets"][-1]["invalid"] == 1


def test_usage_errors_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [CORPUS[0], "{not json", CORPUS[1]])
    result = structgen("validate", "--schemas", bad)  # the real command line once; the rest in-process
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"structgen validate: {bad}:2: not valid JSON: Expecting property name enclosed in double quotes (column 2)"
    ]
    no_schema = write_jsonl(tmp_path / "noschema.jsonl", [{"id": "x"}])
    missing = tmp_path / "missing.jsonl"
    cases = [
        (["--schemas", no_schema], f'{no_schema}:1: expected a JSON object with a "schema" key'),
        (["--schemas", missing], f"{missing}: no such file or directory"),
        (
            ["--schemas", bad, "--prompt-template", "no placeholder"],
            "--prompt-template must contain {schema}",
        ),
        (["--schemas", bad, "--resume"], "--resume needs --report"),
        (["--schemas", bad, "--samples", "0"], "--samples must be at least 1"),
    ]
    for args, message in cases:
        assert main(["validate", *map(str, args)]) == 2
        assert capsys.readouterr().err == f"structgen validate: {message}\n"


def test_jsonschemabench_sample_on_tiny(tmp_path: Path) -> None:
    """One schema of each of the 12 subsets through the mechanics: every schema is accounted for."""
    rows = []
    for path in sorted(JSONSCHEMABENCH.glob("*.jsonl")):
        with path.open() as f:
            rows.append(next(f).rstrip("\n"))  # the first schema of each subset (its "subset" field names it)
    corpus = write_jsonl(tmp_path / "sample.jsonl", rows)
    report = tmp_path / "report.jsonl"
    result = structgen(
        "validate",
        "--schemas",
        corpus,
        "--model",
        "tiny",
        "--backend",
        "llguidance",
        "--max-tokens",
        "2",
        "--max-schema-chars",
        "200",
        "--report",
        report,
        "--format",
        "json",
        "--no-progress",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    schemas, samples = report_lines(report)
    assert len(schemas) == 12 and len({s["subset"] for s in schemas.values()}) == 12
    compiled = [s for s in schemas.values() if s["status"] == "compiled"]
    assert len(compiled) >= 9  # llguidance alone refuses a few keywords
    assert {s["id"] for s in samples} == {s["id"] for s in compiled}
    labelled = [s for s in compiled if s["labels"]]
    assert labelled and all(s["labels"]["valid_accepted"] <= s["labels"]["valid"] for s in labelled)
    rows = json.loads(result.stdout)["subsets"]
    assert [r["subset"] for r in rows][-1] == "all" and rows[-1]["schemas"] == 12


def test_smollm2_outputs_finish_and_validate(tmp_path: Path) -> None:
    """The default model answers three small real schemas within 64 tokens, and every answer validates."""
    wanted = {"Github_trivial---o10018", "BFCL_simple_0", "Github_easy---o10008"}
    rows = []
    for name in ("Github_trivial", "BFCL_simple", "Github_easy"):
        with (JSONSCHEMABENCH / f"{name}.jsonl").open() as f:
            rows += [json.loads(line) for line in f if any(f'"{w}"' in line[:80] for w in wanted)]
    corpus = write_jsonl(tmp_path / "three.jsonl", rows)
    report = tmp_path / "report.jsonl"
    result = structgen(
        "validate",
        "--schemas",
        corpus,
        "--backend",
        "llguidance",
        "--max-tokens",
        "64",
        "--report",
        report,
        "--format",
        "markdown",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr
    schemas, samples = report_lines(report)
    assert sorted(schemas) == sorted(wanted)
    assert [s["status"] for s in samples] == ["valid"] * 3, samples
    assert all(json.loads(s["text"]) is not None and s["latency_s"] > 0 for s in samples)
    assert "| all | 3 | 3 (100.0%) |" in result.stdout
