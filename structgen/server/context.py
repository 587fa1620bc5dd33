"""What every route of one app shares: the engine, its tokenizer, the served name, limits, metrics, lifecycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structgen.engine.async_engine import AsyncEngine
    from structgen.server.lifecycle import Lifecycle
    from structgen.server.limits import ServerLimits
    from structgen.server.metrics import ServerMetrics


@dataclass(slots=True, kw_only=True)
class ServerContext:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    limits: ServerLimits
    metrics: ServerMetrics
    lifecycle: Lifecycle
