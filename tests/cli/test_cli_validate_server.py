"""`structgen validate --server URL` against a live server on the session's SmolLM2 engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_helpers import report_lines, structgen, write_jsonl
from live_server import serve, wait_idle

from structgen.server import build_app
from structgen.validate.local import build_backends

CORPUS = [
    {
        "id": "city",
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Lisbon", "Paris"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        # Labels are not checked through a server (it does not expose its grammar): ignored, not an error.
        "tests": [{"data": {"city": "Rome"}, "valid": False}],
    },
    {"id": "bad", "schema": {"type": 3}},
    {"id": "remote", "schema": {"$ref": "http://example.com/schema.json"}},
]


def test_validate_through_a_server(tmp_path: Path, smollm2_engine: Any) -> None:
    corpus = write_jsonl(tmp_path / "srv.jsonl", CORPUS)
    report = tmp_path / "report.jsonl"
    # The manager builds the fallback backends inside the first compile, under its time limit; a shared CPU
    # can take longer than that, so build them first (the fixture keeps them for later tests).
    build_backends(smollm2_engine.engine)
    app = build_app(smollm2_engine, smollm2_engine.engine.tokenizer, model_name="smollm2-135m", api_key="k")
    with serve(app) as url:
        args = ["validate", "--schemas", corpus, "--server", url, "--api-key", "k", "--samples", "2"]
        result = structgen(*args, "--temperature", "0.7", "--seed", "1", "--report", report, "--no-progress")
        refused = structgen("validate", "--schemas", corpus, "--server", url, "--api-key", "wrong")
    wait_idle(smollm2_engine)
    assert result.returncode == 0, result.stderr
    schemas, samples = report_lines(report)
    assert {k: v["status"] for k, v in schemas.items()} == {
        "city": "compiled",
        "bad": "invalid_schema",
        "remote": "unsupported",
    }
    assert schemas["remote"]["keyword"] == "$ref" and schemas["city"]["labels"] is None
    assert [(s["index"], s["status"]) for s in samples] == [(0, "valid"), (1, "valid")]
    assert all(s["text"] in ('{"city":"Lisbon"}', '{"city":"Paris"}') for s in samples)
    assert refused.returncode == 2
    assert refused.stderr.startswith("structgen validate: ") and refused.stderr.count("\n") == 1
    assert "401" in refused.stderr
