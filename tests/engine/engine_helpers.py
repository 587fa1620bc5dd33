"""Helpers shared by the engine tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from structgen.engine.llm_engine import LLMEngine

EngineFactory = Callable[..., LLMEngine]
"""The `make_engine` fixture: `make_engine(kv_cache_tokens=..., max_num_batched_tokens=..., ...)`."""


def run_all(engine: LLMEngine, max_steps: int = 2000) -> dict[str, Any]:
    """Step until every request finished; returns the final RequestOutput of each request by id.

    Idle steps (nothing scheduled while grammars compile) sleep briefly and do not count as progress."""
    finished: dict[str, Any] = {}
    steps = 0
    idle_deadline = time.monotonic() + 120  # a compile never takes this long here: idling past it is a hang
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if engine.last_step_num_tokens == 0:
            assert time.monotonic() < idle_deadline, "engine idled without progress"
            time.sleep(0.002)
            continue
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return finished
