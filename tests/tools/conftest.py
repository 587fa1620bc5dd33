"""Fixtures for the tool-calling tests: the `tiny` model's cl100k tokenizer and an llguidance backend on it."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from structgen.models.registry import resolve_model
from structgen.structured import StructuredBackend, TokenizerInfo, create_backend
from structgen.tokenizer import Tokenizer
from structgen.tools import ToolCallPlan


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("tiny"))


@pytest.fixture(scope="session")
def llguidance_backend(tiny_tokenizer: Tokenizer) -> StructuredBackend:
    vocab_size = int(json.loads((resolve_model("tiny") / "config.json").read_text())["vocab_size"])
    return create_backend("llguidance", TokenizerInfo.from_tokenizer(tiny_tokenizer, vocab_size=vocab_size))


@pytest.fixture(scope="session")
def accepts(
    tiny_tokenizer: Tokenizer, llguidance_backend: StructuredBackend
) -> Callable[[ToolCallPlan, str], bool]:
    """Whether the plan's grammar accepts `text` as a complete output."""

    def check(plan: ToolCallPlan, text: str) -> bool:
        structured = plan.structured_outputs()
        assert structured is not None
        grammar = llguidance_backend.compile(structured.to_spec())
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        return grammar.accept_tokens(ids) and grammar.matcher.is_accepting()

    return check
