"""The structured-output fields of a request: which constraint it names (`response_format`, vLLM's `guided_*`,
or `structured_outputs`) and the options that tune it.

A `structured_outputs` object holding only options (`close_at_budget`, `loop_guard`, `whitespace`,
`max_whitespace`, `strict`) names no constraint of its own: it applies to the one `response_format`, a
`guided_*` field or the tools give, so a client can turn budget closing off for its `response_format` without
rewriting the request in vLLM's terms. Every problem is a 400 whose `param` names the field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from structgen.server.errors import APIError

if TYPE_CHECKING:
    from structgen.structured import StructuredOutputsParams

CONSTRAINT_FIELDS = ("json", "json_object", "regex", "grammar", "choice")
OPTION_FIELDS = ("whitespace", "max_whitespace", "strict", "close_at_budget", "loop_guard")
_FIELD = "structured_outputs"


def structured_options(structured_outputs: dict[str, Any] | None) -> dict[str, Any]:
    """The options `structured_outputs` sets, checked (400 naming `structured_outputs.<option>`)."""
    if structured_outputs is None:
        return {}
    unknown = sorted(set(structured_outputs) - set(CONSTRAINT_FIELDS) - set(OPTION_FIELDS))
    if unknown:
        raise APIError(400, f"unknown {_FIELD} field(s): {', '.join(unknown)}", param=_FIELD)
    options = {name: structured_outputs[name] for name in OPTION_FIELDS if name in structured_outputs}
    from structgen.structured import InvalidSpecError, StructuredOutputsParams

    try:  # the options are checked where they are defined, on a throwaway constraint
        StructuredOutputsParams(json_object=True, **options)
    except InvalidSpecError as error:
        raise _invalid(_FIELD, error) from None
    return options


def options_only(structured_outputs: dict[str, Any] | None) -> bool:
    """Whether `structured_outputs` is there but names no constraint (only options, or nothing)."""
    return structured_outputs is not None and not set(structured_outputs) & set(CONSTRAINT_FIELDS)


def resolve_structured(
    *,
    response_format: dict[str, Any] | None,
    guided: dict[str, Any],
    structured_outputs: dict[str, Any] | None,
    has_tools: bool,
) -> StructuredOutputsParams | None:
    """The request's one constraint, with the options of `structured_outputs` applied; None for none.

    `guided` maps vLLM's `guided_*` field names to their values; `has_tools`: the tools may take the options
    (`ToolCallPlan.sampling_params`), so options without a constraint of their own are not a mistake.
    """
    from structgen.structured import InvalidSpecError, StructuredOutputsParams

    options = structured_options(structured_outputs)
    bare = options_only(structured_outputs)
    text = response_format is not None and response_format.get("type") == "text"
    sources = (
        ("response_format", None if text else response_format),
        *guided.items(),
        (_FIELD, None if bare else structured_outputs),
    )
    given = {name: value for name, value in sources if value is not None}
    if len(given) > 1:
        raise APIError(400, f"set at most one of {', '.join(given)}", param=next(iter(given)))
    if not given:
        if bare and not has_tools:
            raise APIError(
                400,
                f"{_FIELD} names no constraint (set one of {', '.join(CONSTRAINT_FIELDS)}), and the request has "
                f"no response_format, guided_* field or tools for its options ({', '.join(OPTION_FIELDS)}) "
                "to apply to",
                param=_FIELD,
            )
        return None
    name, value = next(iter(given.items()))
    try:
        if name == _FIELD:
            return StructuredOutputsParams(**value)
        if name == "response_format":
            params = StructuredOutputsParams.from_response_format(value)
        else:
            params = StructuredOutputsParams(**{name.removeprefix("guided_"): value})
        return replace(params, **options) if params is not None and options else params
    except InvalidSpecError as error:
        raise _invalid(name, error) from None


def _invalid(name: str, error: Exception) -> APIError:
    """A 400 for a spec error; `structured_outputs.<option>` when the message starts with the option's name."""
    message = str(error)
    head = message.split(" ", 1)[0]
    param = f"{_FIELD}.{head}" if name == _FIELD and head in OPTION_FIELDS else name
    return APIError(400, message, param=param, code="invalid_value")
