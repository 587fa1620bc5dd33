"""The OpenAI-compatible HTTP server: `build_app(engine, tokenizer, model_name=...)` and `structgen serve`."""

from structgen.server.app import build_app
from structgen.server.limits import ServerLimits

__all__ = ["ServerLimits", "build_app"]
