"""Benchmarks shipped with the package so `structgen bench NAME` can run them; `benchmarks/NAME.py` wraps each.

Every module here exposes `main(argv: Sequence[str] | None = None) -> int`, measures its baseline in the same
run, prints a table of ratios, and can write its numbers as JSON.
"""

from __future__ import annotations

import os
from pathlib import Path


def shared_data() -> Path:
    """The public test data: `$STRUCTGEN_DATA`, else `../shared/data` beside the repository checkout."""
    env = os.environ.get("STRUCTGEN_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
