"""Errors of the structured-output layer. Each names what is wrong (keyword, JSON path, backend, time limit)
so the server can turn it into a 400 the user can act on."""

from __future__ import annotations

from structgen.errors import StructgenError


class StructuredOutputError(StructgenError):
    """A structured-output request cannot be served: bad spec, compile failure, time limit, rejected token."""


class InvalidSpecError(StructuredOutputError, ValueError):
    """The request's spec itself is malformed (not JSON, two kinds at once, an empty choice list...)."""


class UnsupportedSchemaError(StructuredOutputError):
    """No grammar can enforce a keyword of the schema (exactly or under a validated relaxation).

    `keyword` is the JSON Schema keyword (e.g. "not", "format") and `path` the JSON pointer of the subschema
    that holds it (e.g. "#/properties/tags"); `backend` names the backend that refused, when one did.
    """

    def __init__(
        self, message: str, *, keyword: str | None = None, path: str | None = None, backend: str | None = None
    ):
        self.keyword = keyword
        self.path = path
        self.backend = backend
        where = ""
        if keyword is not None:
            where = f"keyword {keyword!r}" + (f" at {path}" if path else "")
        elif path is not None:
            where = f"at {path}"
        prefix = f"[{backend}] " if backend else ""
        super().__init__(f"{prefix}{where}: {message}" if where else f"{prefix}{message}")


class CompileTimeoutError(StructuredOutputError):
    """Compiling the grammar took longer than the configured limit."""

    def __init__(self, limit_s: float, what: str):
        self.limit_s = limit_s
        super().__init__(f"compiling the grammar for {what} exceeded the {limit_s:g} s limit")


class CompileBusyError(StructuredOutputError):
    """Too many earlier compiles are still running past their time limit: new ones are refused for now."""

    def __init__(self, num_running: int):
        self.num_running = num_running
        super().__init__(
            f"{num_running} grammar compiles are still running past their time limit; try again later"
        )


class GrammarRejectedTokenError(StructuredOutputError):
    """A sampled token was rejected by its grammar: the mask and the matcher disagree, which is a bug."""
