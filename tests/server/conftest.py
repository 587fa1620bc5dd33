"""The engines the server tests share (random weights: only the mechanics matter): `tiny`, and `tiny-thinking`
with a reasoning parser."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import KEY, tiny_engine, tiny_thinking_engine

from structgen.engine.async_engine import AsyncEngine
from structgen.server import build_app


@pytest.fixture(scope="session")
def engine() -> Iterator[AsyncEngine]:
    """Shared by the server tests on `tiny`; each leaves it idle."""
    async_engine = tiny_engine()
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="session")
def thinking_engine() -> Iterator[AsyncEngine]:
    """`tiny-thinking` with the deepseek_r1 parser, shared by the reasoning tests (chat and Responses)."""
    async_engine = tiny_thinking_engine("deepseek_r1")
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def thinking_app(thinking_engine: AsyncEngine) -> Any:
    """An app per test module (one that serves it over a socket shuts it down when done)."""
    return build_app(
        thinking_engine, thinking_engine.engine.tokenizer, model_name="tiny-thinking", api_key=KEY
    )
