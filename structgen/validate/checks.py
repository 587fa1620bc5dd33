"""What the in-process and the server runner share: the prompt, the up-front schema check, and the verdict
on one output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from structgen.validate.records import SampleStatus

DEFAULT_PROMPT_TEMPLATE = (
    "Write one JSON value that is valid under the JSON Schema below, with realistic example content. "
    "Reply with the JSON only.\n\nJSON Schema:\n{schema}"
)


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    samples: int = 1
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    # Long schemas are cut in the prompt (the grammar still enforces all of it): a 135M model's context is short.
    max_schema_chars: int = 2000


def build_prompt(options: GenerationOptions, schema: Any) -> str:
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > options.max_schema_chars:
        text = text[: options.max_schema_chars] + " ... (truncated)"
    # Not str.format: a template may hold JSON braces of its own.
    return options.prompt_template.replace("{schema}", text)


def schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a valid JSON Schema (under its declared draft), or None."""
    import warnings

    import jsonschema

    if not isinstance(schema, (dict, bool)):
        return f"a JSON Schema must be an object or a boolean, got {type(schema).__name__}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unknown $schema URI: checked as 2020-12
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        return f"not a valid JSON Schema at {where}: {' '.join(e.message.split())[:200]}"
    except Exception as e:  # an unreadable $schema URI, a pathological nesting depth
        return f"not a valid JSON Schema: {type(e).__name__}: {e}"[:300]
    return None


def judge(
    finish_reason: str | None, text: str, schema: Any, error: str | None
) -> tuple[SampleStatus, str | None]:
    """A finished output validates or not (jsonschema, formats checked); a cut or failed one is neither."""
    from structgen.structured.validate import validate_json

    if finish_reason == "length":
        return "truncated", None
    if finish_reason != "stop":
        return "error", error or f"finish_reason {finish_reason}"
    result = validate_json(text, schema)
    if result.valid:
        return "valid", None
    return "invalid", f"{result.keyword} at {result.path}: {result.error}"
