"""The OpenAI-compatible HTTP server: `build_app(engine, tokenizer, model_name=...)` and `structgen serve`."""

from structgen.server.app import build_app

__all__ = ["build_app"]
