"""The IRI formats' parser is built on the first IRI checked, and checks as the package does."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from structgen.structured import iri_syntax

CHECKS = """
import sys
import structgen  # registers the stand-in
import jsonschema
from structgen.structured.formats import format_checker

assert "rfc3987_syntax.syntax_helpers" not in sys.modules, "the parser was built at import"
checker = format_checker()
verdicts = [checker.conforms(v, f) for v, f in [
    ("http://example.com/caf\\u00e9?q=1#frag", "iri"),
    ("http://ex ample.com", "iri"),
    ("../relative/path", "iri-reference"),
    ("../relative/path", "iri"),
    ("://", "iri"),
]]
assert verdicts == [True, False, True, False, False], verdicts
assert "rfc3987_syntax.syntax_helpers" in sys.modules
import rfc3987_syntax
assert rfc3987_syntax.parse("iri", "urn:isbn:0451450523").data == "iri"
assert "iri" in rfc3987_syntax.RFC3987_SYNTAX_TERMS
print("ok")
"""


def test_the_parser_is_built_on_first_use_and_checks_iris() -> None:
    done = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_install_leaves_an_imported_package_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    already = types.ModuleType(iri_syntax.PACKAGE)
    monkeypatch.setitem(sys.modules, iri_syntax.PACKAGE, already)
    assert iri_syntax.install() is False
    assert sys.modules[iri_syntax.PACKAGE] is already


def test_install_without_the_package_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, iri_syntax.PACKAGE, raising=False)
    monkeypatch.setattr(iri_syntax.importlib.machinery.PathFinder, "find_spec", lambda name: None)
    assert iri_syntax.install() is False
    assert iri_syntax.PACKAGE not in sys.modules
