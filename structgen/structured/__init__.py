"""Structured output: JSON Schema / json_object / regex / grammar / choice compiled into token bitmasks.

The engine creates one `StructuredOutputManager` per model; each request's `StructuredOutputsParams` becomes
a canonical `StructuredSpec`, compiled off the hot path into a `Grammar` that fills its row of the batch
bitmask every step (`apply_token_bitmask_` masks the logits) and accepts each sampled token.
"""

from structgen.structured.backend import BACKEND_NAMES, Grammar, StructuredBackend, create_backend
from structgen.structured.bitmask import allocate_token_bitmask, apply_token_bitmask_, bitmask_width
from structgen.structured.errors import (
    CompileTimeoutError,
    GrammarRejectedTokenError,
    InvalidSpecError,
    StructuredOutputError,
    UnsupportedSchemaError,
)
from structgen.structured.manager import StructuredOutputConfig, StructuredOutputManager
from structgen.structured.normalize import SchemaChange, ServingPath, normalize_schema
from structgen.structured.select import CompiledSpec, compile_spec
from structgen.structured.spec import StructuredOutputsParams, StructuredSpec
from structgen.structured.tokenizer_info import TokenizerInfo
from structgen.structured.validate import ValidationResult, validate_output

__all__ = [
    "BACKEND_NAMES",
    "CompileTimeoutError",
    "CompiledSpec",
    "Grammar",
    "GrammarRejectedTokenError",
    "InvalidSpecError",
    "SchemaChange",
    "ServingPath",
    "StructuredBackend",
    "StructuredOutputConfig",
    "StructuredOutputError",
    "StructuredOutputManager",
    "StructuredOutputsParams",
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
