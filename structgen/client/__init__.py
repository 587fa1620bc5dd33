"""Typed client for structgen's (or any) OpenAI-compatible server: Pydantic objects back instead of strings.

    from structgen.client import Client
    person = Client(base_url="http://127.0.0.1:8000").parse(Person, prompt="Maria is 34, from Lisbon.")

It speaks HTTP only (httpx) and imports nothing of the engine.
"""

from structgen.client.aio import AsyncClient
from structgen.client.errors import (
    APIConnectionError,
    APIStatusError,
    AuthenticationError,
    BadRequestError,
    ClientError,
    InternalServerError,
    NotFoundError,
    OutputError,
    OutputValidationError,
    RateLimitError,
    TruncatedOutputError,
)
from structgen.client.partial import MISSING, parse_partial
from structgen.client.reasoning import Parsed
from structgen.client.sync import Client
from structgen.client.targets import Target, as_target
from structgen.client.tools import Tool, ToolCall, ToolRun, as_tool

__all__ = [
    "MISSING",
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ClientError",
    "InternalServerError",
    "NotFoundError",
    "OutputError",
    "OutputValidationError",
    "Parsed",
    "RateLimitError",
    "Target",
    "Tool",
    "ToolCall",
    "ToolRun",
    "TruncatedOutputError",
    "as_target",
    "as_tool",
    "parse_partial",
]
