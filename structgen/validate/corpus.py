"""Reading a schema corpus: a JSONL file (one `{"id"?, "schema", "subset"?, "tests"?}` a line, MaskBench's
format), a directory of `.json` schema files, or one schema file. Errors name the file and line."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CorpusError(Exception):
    """The corpus cannot be read: a missing file, a line that is not a JSON object with a schema."""


@dataclass(slots=True)
class SchemaCase:
    id: str
    subset: str
    schema: Any
    # MaskBench labels: `{"data": instance, "valid": bool}` each.
    tests: list[dict[str, Any]] = field(default_factory=list)


def load_corpus(path: Path) -> list[SchemaCase]:
    """Every schema of `path` in file order (a directory: its `*.json` and `*.jsonl` files by name)."""
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.is_file())
        if not files:
            raise CorpusError(f"{path}: no .json or .jsonl files")
        # Loose schema files of one directory form one subset; a JSONL file is its own subset.
        cases = [case for f in files for case in _load_file(f, loose_subset=path.name)]
    else:
        cases = _load_file(path, loose_subset=path.stem)
    seen: set[str] = set()
    for case in cases:
        if case.id in seen:
            raise CorpusError(f"{path}: schema id {case.id!r} appears twice")
        seen.add(case.id)
    return cases


def stratified(cases: list[SchemaCase], per_subset: int) -> list[SchemaCase]:
    """`per_subset` schemas of each subset, evenly spaced through it: the same spread on every run."""
    by_subset: dict[str, list[SchemaCase]] = {}
    for case in cases:
        by_subset.setdefault(case.subset, []).append(case)
    picked = []
    for group in by_subset.values():
        stride = max(1, len(group) // per_subset)
        picked.extend(group[::stride][:per_subset])
    return picked


def _load_file(path: Path, *, loose_subset: str) -> list[SchemaCase]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path}: cannot read: {e}") from None
    if path.suffix == ".jsonl":
        cases = []
        for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: \u2028 is in strings
            if line.strip():
                cases.append(_case(_parse(line, f"{path}:{number}"), path, f"{path}:{number}", number))
        return cases
    # A single schema file: the file is the schema, unless it is a corpus line's shape ({"schema": ...}).
    value = _parse(text, str(path))
    if isinstance(value, dict) and "schema" in value and not _looks_like_schema(value):
        return [_case(value, path, str(path), None)]
    return [SchemaCase(id=path.stem, subset=loose_subset, schema=value)]


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None


def _case(row: Any, path: Path, where: str, number: int | None) -> SchemaCase:
    if not isinstance(row, dict) or "schema" not in row:
        raise CorpusError(f'{where}: expected a JSON object with a "schema" key')
    tests = row.get("tests") or []
    if not isinstance(tests, list) or not all(
        isinstance(t, dict) and "data" in t and isinstance(t.get("valid"), bool) for t in tests
    ):
        raise CorpusError(f'{where}: "tests" must be a list of {{"data": ..., "valid": true|false}}')
    default_id = path.stem if number is None else f"{path.stem}:{number}"
    return SchemaCase(
        id=str(row.get("id", default_id)),
        subset=str(row.get("subset", path.stem)),
        schema=row["schema"],
        tests=tests,
    )


def _looks_like_schema(value: dict[str, Any]) -> bool:
    """A schema with a property literally named "schema" is still a schema, not a corpus line."""
    return any(k in value for k in ("type", "properties", "$schema", "$defs", "definitions", "anyOf"))
