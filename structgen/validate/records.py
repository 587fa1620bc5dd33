"""What a validate run records: one `SchemaRecord` per schema and one `SampleRecord` per output, written as
report lines (`{"kind": "schema" | "sample", ...}`) and summarized per subset. A schema's samples come before
its schema line, so a schema line in a report means the schema is finished (what `--resume` relies on)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

SchemaStatus = Literal["compiled", "unsupported", "invalid_schema", "timeout", "error"]
SampleStatus = Literal["valid", "invalid", "truncated", "error"]


@dataclass(slots=True)
class SchemaRecord:
    id: str
    subset: str
    status: SchemaStatus
    backend: str | None = None
    path: str | None = None  # serving path: exact / rewritten / restricted / relaxed
    keyword: str | None = None  # the keyword no backend could enforce (unsupported)
    error: str | None = None
    compile_s: float | None = None
    labels: dict[str, int] | None = None  # LabelCounts.to_dict(); None when there are no labels or no grammar

    def to_json(self) -> str:
        return json.dumps({"kind": "schema", **asdict(self)}, ensure_ascii=False)


@dataclass(slots=True)
class SampleRecord:
    id: str
    subset: str
    index: int
    status: SampleStatus
    finish_reason: str | None
    text: str
    tokens: int
    latency_s: float | None
    error: str | None = None  # why it is invalid (first validation error) or failed

    def to_json(self) -> str:
        return json.dumps({"kind": "sample", **asdict(self)}, ensure_ascii=False)


def read_report(path: Path) -> tuple[list[SchemaRecord], list[SampleRecord]]:
    """The finished schemas of a report and their samples; samples of an unfinished schema (the run stopped
    mid-schema) and a torn last line are dropped, so that schema runs again on resume."""
    schemas: list[SchemaRecord] = []
    samples: list[SampleRecord] = []
    lines = path.read_text(encoding="utf-8").rstrip("\n").split("\n")
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
            kind = row.pop("kind")
            if kind == "schema":
                schemas.append(SchemaRecord(**_known(SchemaRecord, row)))
            elif kind == "sample":
                samples.append(SampleRecord(**_known(SampleRecord, row)))
            else:
                raise KeyError(kind)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            if number == len(lines):
                break  # the line a killed run was writing
            raise ValueError(f"{path}:{number}: not a validate report line") from None
    finished = {s.id for s in schemas}
    return schemas, [s for s in samples if s.id in finished]


def _known(cls: type, row: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in row.items() if k in names}
