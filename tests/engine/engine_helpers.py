"""Helpers shared by the engine tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from structgen.engine.llm_engine import LLMEngine
from structgen.engine.sequence import SequenceStatus

EngineFactory = Callable[..., LLMEngine]
"""The `make_engine` fixture: `make_engine(kv_cache_tokens=..., max_num_batched_tokens=..., ...)`."""


def run_all(engine: LLMEngine, max_steps: int = 2000) -> dict[str, Any]:
    """Step until every request finished; returns the final RequestOutput of each request by id.

    The grammars of the requests already added compile before the first step (`wait_for_grammars`); idle steps
    (nothing scheduled while later requests' grammars compile) sleep briefly and do not count as progress."""
    wait_for_grammars(engine)
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


def wait_for_grammars(engine: LLMEngine, timeout: float = 120.0) -> None:
    """Wait until the compile of every waiting request's grammar has finished. Without it, the first steps batch whichever
    requests happen to be ready, which depends on the machine's load; and the test model's greedy picks depend
    on the batch (its near-tied logits round differently in another batch), so runs compared token for token
    would differ on a busy machine."""
    deadline = time.monotonic() + timeout
    while any(
        seq.status is SequenceStatus.WAITING_FOR_GRAMMAR
        and seq.structured is not None
        and not seq.structured.ready()
        for seq in engine.scheduler.waiting
    ):
        assert time.monotonic() < deadline, "a grammar never finished compiling"
        time.sleep(0.002)
