"""Real servers on the shared SmolLM2 engine for the client tests: an open one and one that needs a key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from client_helpers import API_KEY, MODEL
from live_server import serve, wait_idle

from structgen.server import build_app


def _serve(engine: Any, api_key: str | None) -> Iterator[str]:
    with serve(build_app(engine, engine.engine.tokenizer, model_name=MODEL, api_key=api_key)) as url:
        yield url
    wait_idle(engine)


@pytest.fixture(scope="session")
def base_url(smollm2_engine: Any) -> Iterator[str]:
    yield from _serve(smollm2_engine, None)


@pytest.fixture(scope="session")
def keyed_base_url(smollm2_engine: Any) -> Iterator[str]:
    yield from _serve(smollm2_engine, API_KEY)


@pytest.fixture
def idle(smollm2_engine: Any) -> Iterator[None]:
    """Leaves the shared engine idle after the test, as every user of `smollm2_engine` must."""
    yield
    wait_idle(smollm2_engine)
