"""A budget closer fed as the engine feeds it, and the walks it makes (shared by the closer's tests)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from structured_helpers import compile_schema

from structgen.structured import StructuredBackend
from structgen.structured.budget_closer import BudgetCloser
from structgen.structured.closing import ByteTokens
from structgen.structured.json_scan import JsonScanner


class Stepper:
    """A string member's grammar, its scanner and a closer, fed as the engine feeds them."""

    SCHEMA: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"s": {"type": "string"}},
        "required": ["s"],
    }

    def __init__(self, backend: StructuredBackend, byte_tokens: ByteTokens):
        self.grammar = compile_schema(backend, self.SCHEMA)
        self.tokens = byte_tokens
        self.closer = BudgetCloser(byte_tokens)
        self.scanner = JsonScanner()

    def feed(self, ids: list[int]) -> list[int]:
        assert self.grammar.accept_tokens(ids)
        self.scanner.feed(self.tokens.text(ids))
        return ids

    def step(self, ids: list[int], left: int) -> bool:
        return self.closer.step(self.grammar, self.scanner, left, self.feed(ids), same_value=False)


def count_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per whole walk (`closing.shortest_completion`) from here on."""
    from structgen.structured import closing

    walks: list[int] = []
    original = closing.shortest_completion
    monkeypatch.setattr(closing, "shortest_completion", lambda *a, **k: walks.append(1) or original(*a, **k))
    return walks


def records(
    properties: dict[str, Any], *, min_items: int, required: list[str] | None = None
) -> dict[str, Any]:
    """An array of at least `min_items` closed records (every property required unless `required` says)."""
    record = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }
    return {"type": "array", "minItems": min_items, "items": record}
