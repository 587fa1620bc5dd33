"""The `tiny` engine the server tests share (random weights: only the mechanics matter)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_helpers import tiny_engine

from structgen.engine.async_engine import AsyncEngine


@pytest.fixture(scope="session")
def engine() -> Iterator[AsyncEngine]:
    """Shared by the server tests on `tiny`; each leaves it idle."""
    async_engine = tiny_engine()
    yield async_engine
    async_engine.shutdown()
