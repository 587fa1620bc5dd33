"""structgen: serve open LLMs so that every answer conforms to a schema.

`from structgen import LLM, SamplingParams` is the offline API (`LoRARequest` names an adapter for it). The
heavy modules (torch, the engine) are imported on first use so that `import structgen` stays cheap for the client
and the CLI's help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Before anything imports jsonschema: its IRI format checker's parser is built on the first IRI checked, not at
# every process start (`structgen.structured.iri_syntax`).
from structgen.structured import iri_syntax as _iri_syntax

_iri_syntax.install()

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from structgen.engine.llm import LLM
    from structgen.lora.request import LoRARequest
    from structgen.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from structgen.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from structgen.lora.request import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from structgen.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'structgen' has no attribute {name!r}")
