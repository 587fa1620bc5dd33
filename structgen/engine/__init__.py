"""The engine: paged KV blocks, continuous batching, prefix caching, sampling; `LLMEngine`, `AsyncEngine`, `LLM`.

Names are imported on first use so that importing one submodule (the sampler, say) does not load them all.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structgen.engine.async_engine import AsyncEngine
    from structgen.engine.llm import LLM
    from structgen.engine.llm_engine import LLMEngine
    from structgen.engine.metrics import EngineStats, RequestMetrics
    from structgen.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
    from structgen.engine.sequence import SequenceStatus

_EXPORTS = {
    "AsyncEngine": "structgen.engine.async_engine",
    "LLM": "structgen.engine.llm",
    "LLMEngine": "structgen.engine.llm_engine",
    "EngineStats": "structgen.engine.metrics",
    "RequestMetrics": "structgen.engine.metrics",
    "CompletionOutput": "structgen.engine.outputs",
    "RequestOutput": "structgen.engine.outputs",
    "TokenLogprob": "structgen.engine.outputs",
    "SequenceStatus": "structgen.engine.sequence",
}
__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineStats",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SequenceStatus",
    "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'structgen.engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
