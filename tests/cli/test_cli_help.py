"""`structgen --help` and each subcommand's help answer without importing the engine, torch or jsonschema."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "jsonschema", "transformers", "structgen.engine", "structgen.server")


@pytest.mark.parametrize("argv", [[], ["serve"], ["generate"], ["validate"], ["run-batch"], ["bench"]])
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from structgen.cli import main\n"
        "try:\n"
        f"    main({[*argv, '--help']!r})\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0, done.code\n"
        f"heavy = sorted(m for m in sys.modules if m.startswith({HEAVY!r}))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: structgen" in done.stdout
