"""Structured output: JSON Schema / json_object / regex / grammar / choice compiled into token bitmasks.

The engine creates one `StructuredOutputManager` per model and installs a `StructuredLogitsProcessor`; each
request's `StructuredOutputsParams` becomes a `StructuredRequest`: its canonical `StructuredSpec` compiles off
the hot path into a `Grammar` that fills its row of the batch bitmask every step (`apply_token_bitmask_`
masks the logits), accepts each sampled token, offers jump-forward tokens, and has the finished output
validated against the original schema.
"""

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
