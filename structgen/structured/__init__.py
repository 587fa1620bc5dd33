"""Structured output: JSON Schema / json_object / regex / grammar / choice compiled into token bitmasks.

The engine creates one `StructuredOutputManager` per model and installs a `StructuredLogitsProcessor`; each
request's `StructuredOutputsParams` becomes a `StructuredRequest`: its canonical `StructuredSpec` compiles off
the hot path into a `Grammar` that fills its row of the batch bitmask every step (`apply_token_bitmask_`
masks the logits), accepts each sampled token, offers jump-forward tokens, and has the finished output
validated against the original schema.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structgen.structured.backend import BACKEND_NAMES, Grammar, StructuredBackend, create_backend
    from structgen.structured.bitmask import allocate_token_bitmask, apply_token_bitmask_, bitmask_width
    from structgen.structured.errors import (
        CompileBusyError,
        CompileTimeoutError,
        GrammarRejectedTokenError,
        InvalidSpecError,
        StructuredOutputError,
        UnsupportedSchemaError,
    )
    from structgen.structured.limits import SchemaLimits
    from structgen.structured.logits_processor import StructuredLogitsProcessor
    from structgen.structured.manager import StructuredOutputConfig, StructuredOutputManager
    from structgen.structured.normalize import SchemaChange, ServingPath, normalize_schema
    from structgen.structured.request import StructuredRequest
    from structgen.structured.select import CompiledSpec, compile_spec
    from structgen.structured.spec import StructuredOutputsParams, StructuredSpec
    from structgen.structured.tokenizer_info import TokenizerInfo
    from structgen.structured.validate import ValidationResult, validate_output

# Each name is imported from its module on first use (PEP 562): the package's modules reach torch and jsonschema,
# and a light one (`structgen.structured.unroll`'s constant, for the CLI's `--help`) should not pay for them.
_SOURCES: dict[str, str] = {
    "BACKEND_NAMES": "structgen.structured.backend",
    "CompileBusyError": "structgen.structured.errors",
    "CompileTimeoutError": "structgen.structured.errors",
    "CompiledSpec": "structgen.structured.select",
    "Grammar": "structgen.structured.backend",
    "GrammarRejectedTokenError": "structgen.structured.errors",
    "InvalidSpecError": "structgen.structured.errors",
    "SchemaChange": "structgen.structured.normalize",
    "SchemaLimits": "structgen.structured.limits",
    "ServingPath": "structgen.structured.normalize",
    "StructuredBackend": "structgen.structured.backend",
    "StructuredLogitsProcessor": "structgen.structured.logits_processor",
    "StructuredOutputConfig": "structgen.structured.manager",
    "StructuredOutputError": "structgen.structured.errors",
    "StructuredOutputManager": "structgen.structured.manager",
    "StructuredOutputsParams": "structgen.structured.spec",
    "StructuredRequest": "structgen.structured.request",
    "StructuredSpec": "structgen.structured.spec",
    "TokenizerInfo": "structgen.structured.tokenizer_info",
    "UnsupportedSchemaError": "structgen.structured.errors",
    "ValidationResult": "structgen.structured.validate",
    "allocate_token_bitmask": "structgen.structured.bitmask",
    "apply_token_bitmask_": "structgen.structured.bitmask",
    "bitmask_width": "structgen.structured.bitmask",
    "compile_spec": "structgen.structured.select",
    "create_backend": "structgen.structured.backend",
    "normalize_schema": "structgen.structured.normalize",
    "validate_output": "structgen.structured.validate",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'structgen.structured' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


__all__ = [
    "BACKEND_NAMES",
    "CompileBusyError",
    "CompileTimeoutError",
    "CompiledSpec",
    "Grammar",
    "GrammarRejectedTokenError",
    "InvalidSpecError",
    "SchemaChange",
    "SchemaLimits",
    "ServingPath",
    "StructuredBackend",
    "StructuredLogitsProcessor",
    "StructuredOutputConfig",
    "StructuredOutputError",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "StructuredRequest",
    "StructuredSpec",
    "TokenizerInfo",
    "UnsupportedSchemaError",
    "ValidationResult",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_width",
    "compile_spec",
    "create_backend",
    "normalize_schema",
    "validate_output",
]
