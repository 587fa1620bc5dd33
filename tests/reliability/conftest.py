"""The `tiny` engine the server-side reliability tests share (random weights: only the mechanics matter);
each test leaves it idle."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from reliability_helpers import tiny_engine

from structgen.engine.async_engine import AsyncEngine


@pytest.fixture(scope="session")
def server_tiny_engine() -> Iterator[AsyncEngine]:
    async_engine = tiny_engine()
    yield async_engine
    async_engine.shutdown()
