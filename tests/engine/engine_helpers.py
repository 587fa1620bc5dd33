"""Helpers shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from structgen.engine.llm_engine import LLMEngine

EngineFactory = Callable[..., LLMEngine]
"""The `make_engine` fixture: `make_engine(kv_cache_tokens=..., max_num_batched_tokens=..., ...)`."""


def run_all(engine: LLMEngine, max_steps: int = 2000) -> dict[str, Any]:
    """Step until every request finished; returns the final RequestOutput of each request by id."""
    finished: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return finished
