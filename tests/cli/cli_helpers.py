"""Run `structgen` as a subprocess the way a user does, and read a validate report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def structgen(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "structgen.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def report_lines(path: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """(schema records by id, sample records) of a validate report."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    schemas = {r["id"]: r for r in rows if r["kind"] == "schema"}
    return schemas, [r for r in rows if r["kind"] == "sample"]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
