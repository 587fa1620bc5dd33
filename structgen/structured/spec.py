"""Request → canonical spec. A request names one of five kinds of constraint (JSON Schema, any JSON object,
regex, grammar, choice); the canonical spec is what compiles and what the compile cache is keyed on."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from structgen.structured.errors import InvalidSpecError

SpecKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
GrammarSyntax = Literal["lark", "ebnf"]
WhitespaceMode = Literal["compact", "flexible"]

# A GBNF/EBNF rule is `name ::= ...`; Lark writes `name: ...`.
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)
DEFAULT_MAX_WHITESPACE = 4
# A `$ref` inside a grammar's embedded JSON Schema (`%json {...}`): only local ones ("#...") may stand, so no
# grammar can make a backend read a file or fetch a URL.
_GRAMMAR_REF = re.compile(r'"\$ref"\s*:\s*"([^"]*)"')


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """Canonical form of one constraint; equal specs compile to the same grammar.

    `text` is compact JSON (in the schema's own key order: property order is part of the output format)
    for `json_schema` and `choice`, the pattern for `regex`, the grammar source for `grammar`, "" for
    `json_object`. `whitespace` is "compact" (no whitespace between JSON tokens) or "flexible" (up to
    `max_whitespace` whitespace characters in each gap, so a model can never loop on whitespace).
    """

    kind: SpecKind
    text: str
    syntax: GrammarSyntax | None = None
    whitespace: WhitespaceMode = "compact"
    max_whitespace: int = DEFAULT_MAX_WHITESPACE

    @property
    def key(self) -> tuple[str, str, str, str, int]:
        """Everything that changes the compiled grammar (the cache key, with backend and tokenizer)."""
        ws = self.max_whitespace if self.whitespace == "flexible" else 0
        return (self.kind, self.syntax or "", self.text, self.whitespace, ws)

    def schema(self) -> dict[str, Any] | bool:
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            raise InvalidSpecError(f"a {self.kind} spec has no JSON Schema")
        return json.loads(self.text)

    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise InvalidSpecError(f"a {self.kind} spec has no choices")
        return json.loads(self.text)

    def with_schema(self, schema: dict[str, Any] | bool) -> StructuredSpec:
        return replace(self, kind="json_schema", text=canonical_json(schema))

    def describe(self) -> str:
        head = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"{self.kind} {head}".strip()


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """The structured-output part of a request (vLLM's field names): set exactly one of `json`,
    `json_object`, `regex`, `grammar`, `choice`.

    `json` takes a JSON Schema as a dict, a JSON string, or a Pydantic model class. `grammar` takes Lark or
    EBNF/GBNF source (told apart by `::=`). `strict`: an output that still fails validation after the
    allowed retries fails the request instead of being returned flagged as invalid.

    `close_at_budget`: when the tokens left (`max_tokens`, the context) come down to what the grammar needs to
    finish, steer the output onto its shortest valid completion instead of letting `max_tokens` cut it.
    `loop_guard`: end a string or array value the model is filling with the same tokens over and over. None
    for either takes the engine's default (`StructuredOutputConfig`: on for JSON Schema, `json_object` and
    tool calls; off for regex, grammar and choice unless asked for here).
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    whitespace: WhitespaceMode = "compact"
    max_whitespace: int = DEFAULT_MAX_WHITESPACE
    strict: bool = False
    close_at_budget: bool | None = None
    loop_guard: bool | None = None
    _spec: StructuredSpec | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("grammar", self.grammar),
                ("choice", self.choice),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidSpecError(
                "set exactly one of json, json_object, regex, grammar, choice"
                + (f" (got {', '.join(given)})" if given else " (got none)")
            )
        if self.whitespace not in ("compact", "flexible"):
            raise InvalidSpecError(f"whitespace must be 'compact' or 'flexible', got {self.whitespace!r}")
        if not isinstance(self.max_whitespace, int) or not 1 <= self.max_whitespace <= 64:
            raise InvalidSpecError(f"max_whitespace must be an int in 1..64, got {self.max_whitespace!r}")
        # Booleans strictly (`"strict": "no"` would otherwise read as true); None takes the engine's default.
        if not isinstance(self.strict, bool):
            raise InvalidSpecError(f"strict must be a boolean, got {self.strict!r}")
        for name in ("close_at_budget", "loop_guard"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, bool)):  # 1 == True, but 1 is no boolean
                raise InvalidSpecError(f"{name} must be a boolean or null, got {value!r}")
        object.__setattr__(self, "_spec", self._canonicalize())

    def to_spec(self) -> StructuredSpec:
        assert self._spec is not None
        return self._spec

    def _canonicalize(self) -> StructuredSpec:
        ws = {"whitespace": self.whitespace, "max_whitespace": self.max_whitespace}
        if self.json is not None:
            return StructuredSpec("json_schema", canonical_json(_load_schema(self.json)), **ws)
        if self.json_object:
            return StructuredSpec("json_object", "", **ws)
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise InvalidSpecError("regex must be a non-empty string")
            return StructuredSpec("regex", self.regex, **ws)
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise InvalidSpecError("grammar must be a non-empty Lark or EBNF/GBNF string")
            for ref in _GRAMMAR_REF.findall(self.grammar):
                if not ref.startswith("#"):
                    raise InvalidSpecError(
                        f"grammar: $ref {ref!r} is not allowed; schemas inside a grammar may only use local "
                        "references ('#/$defs/...')"
                    )
            syntax: GrammarSyntax = "ebnf" if _EBNF_RULE.search(self.grammar) else "lark"
            return StructuredSpec("grammar", self.grammar, syntax=syntax, **ws)
        choice = self.choice
        if (
            not isinstance(choice, list | tuple)
            or not choice
            or not all(isinstance(c, str) and c for c in choice)
        ):
            raise InvalidSpecError("choice must be a non-empty list of non-empty strings")
        return StructuredSpec("choice", json.dumps(list(dict.fromkeys(choice)), ensure_ascii=False), **ws)

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any]) -> StructuredOutputsParams | None:
        """OpenAI `response_format`: `text` → None, `json_object`, `json_schema` (`strict` honoured)."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            body = response_format.get("json_schema")
            if not isinstance(body, dict) or "schema" not in body:
                raise InvalidSpecError("response_format.json_schema must be an object with a 'schema'")
            return cls(json=body["schema"], strict=bool(body.get("strict", False)))
        raise InvalidSpecError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def canonical_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _load_schema(value: Any) -> dict[str, Any] | bool:
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        value = value.model_json_schema()
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidSpecError(f"json schema is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidSpecError("json schema nests too deeply to be parsed") from None
    if not isinstance(value, dict | bool):
        raise InvalidSpecError(f"a JSON Schema must be an object or a boolean, got {type(value).__name__}")
    try:
        canonical_json(value)
    except (TypeError, ValueError) as e:
        raise InvalidSpecError(f"json schema cannot be serialized as JSON: {e}") from None
    except RecursionError:
        from structgen.structured.limits import too_deep

        raise InvalidSpecError(too_deep(value)) from None
    return value
