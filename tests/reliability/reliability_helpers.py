"""Helpers of the server-side reliability tests: the server tests' helpers (`tests/server/server_helpers.py`:
tiny engines, ASGI calls, the OpenAI error shape) made importable from here, and the app they build."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from server_helpers import AUTH, KEY, USER, assert_error, assert_error_body, call, tiny_engine

from structgen.server import build_app

__all__ = ["AUTH", "KEY", "USER", "assert_error", "assert_error_body", "call", "keyed_app", "tiny_engine"]


def keyed_app(engine: Any, **kwargs: Any) -> Any:
    """The app on the `tiny` `engine`, with the test API key."""
    return build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY, **kwargs)
