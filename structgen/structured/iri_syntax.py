"""rfc3987-syntax, the package that checks the "iri" and "iri-reference" formats, loaded on the first IRI checked.

The package compiles an Earley parser for RFC 3987 when it is imported (about 1.8 s on a 2-core host), and
`jsonschema` imports it when it is imported itself, for those two formats. Every structgen process paid that
at start: the CLI's `--help`, `structgen validate`'s usage errors, each server, each tensor-parallel worker.
`install()` (called by `import structgen`, before anything imports `jsonschema`) registers a stand-in for the
package whose functions import the real parser module on their first call; after that call the stand-in holds
every name the real package exports, so code importing `rfc3987_syntax` itself sees the same module. The
checks are the package's own, unchanged (`structgen.structured.formats` still refuses an install without it).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types
from typing import Any

PACKAGE = "rfc3987_syntax"
_PARSER_MODULE = f"{PACKAGE}.syntax_helpers"  # the module that builds the parser; the package re-exports it
_load_lock = threading.Lock()


class _DeferredPackage(types.ModuleType):
    """The package module without its parser: names other than the two check functions load it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_load(self), name)


def _load(package: types.ModuleType) -> types.ModuleType:
    with _load_lock:
        helpers = importlib.import_module(_PARSER_MODULE)
        # What the real `__init__` does (`from .syntax_helpers import *`), replacing the deferred functions.
        exported = getattr(helpers, "__all__", None) or [n for n in vars(helpers) if not n.startswith("_")]
        for name in exported:
            setattr(package, name, getattr(helpers, name))
    return helpers


def install() -> bool:
    """Register the stand-in unless the package is already imported or not installed; True if registered."""
    if PACKAGE in sys.modules:
        return False
    spec = importlib.machinery.PathFinder.find_spec(PACKAGE)
    if spec is None or spec.submodule_search_locations is None:
        return False  # not installed: `formats.format_checker()` names the missing package
    package = _DeferredPackage(PACKAGE)
    package.__spec__ = spec
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = spec.origin
    package.__package__ = PACKAGE

    def is_valid_syntax(term: str, value: str) -> Any:
        return _load(package).is_valid_syntax(term, value)

    def parse(term: str, value: str) -> Any:
        return _load(package).parse(term, value)

    package.is_valid_syntax = is_valid_syntax  # type: ignore[attr-defined]
    package.parse = parse  # type: ignore[attr-defined]
    sys.modules[PACKAGE] = package
    return True
