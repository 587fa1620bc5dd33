"""Engine fixtures: the `tiny` model loaded once per session, shared by engines with different settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import EngineFactory

from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
from structgen.engine.llm_engine import LLMEngine


@pytest.fixture(scope="session")
def tiny() -> tuple[torch.nn.Module, Any, Path]:
    """(model, tokenizer, checkpoint dir) of the `tiny` model, fp32 on CPU."""
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model
    from structgen.tokenizer import Tokenizer

    model_dir = resolve_model("tiny")
    return load_model(model_dir, dtype="float32", device="cpu"), Tokenizer.from_dir(model_dir), model_dir


@pytest.fixture(scope="session")
def make_engine(tiny: tuple[torch.nn.Module, Any, Path]) -> EngineFactory:
    """`make_engine(kv_cache_tokens=..., max_num_batched_tokens=..., ...)`: a fresh engine on the shared model."""
    model, tokenizer, model_dir = tiny
    cache_fields = {"block_size", "kv_cache_tokens", "enable_prefix_caching", "commit_cpu_kv_at_start"}
    sched_fields = {"max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill"}

    def factory(**overrides: Any) -> LLMEngine:
        cache = {"kv_cache_tokens": 4096} | {k: v for k, v in overrides.items() if k in cache_fields}
        sched = {k: v for k, v in overrides.items() if k in sched_fields}
        rest = {k: v for k, v in overrides.items() if k not in cache_fields | sched_fields}
        config = EngineConfig(
            model="tiny",
            device="cpu",
            cache=CacheConfig(**cache),
            scheduler=SchedulerConfig(**sched),
            **rest,
        )
        return LLMEngine(config, model=model, tokenizer=tokenizer, model_dir=model_dir)

    return factory
