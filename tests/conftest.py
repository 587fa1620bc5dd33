"""Settings for the whole suite, and the SmolLM2 engine shared by every test that needs outputs that finish."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Helpers shared across test folders (`shared_data`, `live_server`) are imported by bare name, like the
# per-folder ones.
sys.path.insert(0, str(Path(__file__).resolve().parent))

SMOLLM2_KV_CACHE_TOKENS = 8192

# The threads an engine starts (step threads, grammar compile and mask pools) go by names starting with this.
ENGINE_THREAD_PREFIX = "structgen-"
# Each such thread seen alive after a test, and the first test it was seen after (the one that started it).
_started_by: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(ENGINE_THREAD_PREFIX)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    for thread in _engine_threads():
        _started_by.setdefault(thread, item.nodeid)


@pytest.fixture(autouse=True, scope="session")
def _no_engine_thread_outlives_the_session() -> Iterator[None]:
    """Every engine a test builds is shut down by the end: one left running holds its model and KV cache for
    the rest of the worker's life, and its step thread competes for the cores. Set up first, so torn down
    after every other session fixture (the shared engines among them); a leak fails the worker's last test."""
    yield
    gc.collect()  # an engine dropped without shutdown ends its pools' threads when collected
    leaked = _engine_threads()
    for thread in leaked:
        thread.join(timeout=5)  # one shutting down now (a pool's idle thread, a step thread finishing)
    leaked = [t for t in leaked if t.is_alive()]
    assert not leaked, "engine threads still running after the session: " + ", ".join(
        f"{t.name} (started by {_started_by.get(t, 'an unknown test')})" for t in leaked
    )


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread() -> Iterator[None]:
    # The test models are tiny: a second intra-op thread buys little, and on a shared 2-core machine (CI, or a
    # developer running other work) spin-waiting threads make each forward 10-20x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_engine() -> Iterator[Any]:
    """One `AsyncEngine` on the default SmolLM2-135M model for the whole session (loading it costs seconds).
    Tests that share it must leave it idle (every request finished or aborted) when they end."""
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.async_engine import AsyncEngine
    from structgen.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="smollm2-135m",
        device="cpu",
        # fp32: the server tests compare a seeded request with its repeat, which reads its prompt from the prefix
        # cache; in bf16 that path's rounding differs from a fresh prefill enough to change sampled tokens.
        dtype="float32",
        cache=CacheConfig(kv_cache_tokens=SMOLLM2_KV_CACHE_TOKENS),
        scheduler=SchedulerConfig(max_num_seqs=32),
    )
    engine = AsyncEngine(LLMEngine(config))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tiny_lora_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random PEFT LoRA adapters for `tiny`, made with `peft` (`lora/peft_adapters.py`), by name: "sql" (rank 8
    on q/v/down) and "poet" (rank 4 on o/gate); each moves the model's greedy picks away from the base model's."""
    from lora.peft_adapters import make_peft_adapter

    from structgen.models.registry import resolve_model

    root = tmp_path_factory.mktemp("lora")
    model_dir = resolve_model("tiny")
    sql = ["q_proj", "v_proj", "down_proj"]
    return {
        "sql": make_peft_adapter(model_dir, root / "sql", r=8, target_modules=sql, lora_alpha=16, seed=1),
        "poet": make_peft_adapter(
            model_dir, root / "poet", r=4, target_modules=["o_proj", "gate_proj"], lora_alpha=8, seed=2
        ),
    }
