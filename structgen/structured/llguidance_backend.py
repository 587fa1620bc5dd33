"""llguidance adapter (the default backend): an Earley parser over a lazily built lexer, masks in ~10 µs.

It refuses what it cannot enforce instead of loosening (with `lenient` off and `coerce_one_of` off, which
we set as overrides so a schema's own `x-guidance` cannot turn them on), so its compile errors are turned
into UnsupportedSchemaError naming the keyword and JSON path for the relaxation step.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch

from structgen.structured.backend import Grammar, StructuredBackend, usable_cpus
from structgen.structured.errors import UnsupportedSchemaError
from structgen.structured.schema_walk import ASSERTION_KEYWORDS, find_keyword, iter_subschemas
from structgen.structured.spec import StructuredSpec
from structgen.structured.support import LLGUIDANCE_SUPPORT
from structgen.structured.tokenizer_info import TokenizerInfo

# llguidance's refusals, mapped to the JSON Schema keyword each is about.
_ERRORS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"oneOf constraints are not supported"), "oneOf"),
    (re.compile(r"min/maxProperties"), "minProperties"),
    (re.compile(r"patternProperty regexes"), "patternProperties"),
    (re.compile(r"look-?arounds?|backreferences|regex parse error|determine if regex is empty"), "pattern"),
    (re.compile(r"intersection stack level"), "allOf"),
    (re.compile(r"circular references with sibling keys|Pointer '.*' does not exist"), "$ref"),
)
# The executor's threads pay off only with rows and cores to spread them over: on 2 shared cores it took
# 17 µs a row where filling the rows one after another took 9 µs.
_PARALLEL_MIN_ROWS = 4
_PARALLEL_MIN_CPUS = 4
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S*)")


class _TokenizerAdapter:
    """What `llguidance.TokenizerWrapper` reads: byte tokens (padded to the model's vocabulary), EOS, the
    special ids, and a canonical `__call__(str) -> ids` used to tokenize forced text."""

    def __init__(self, info: TokenizerInfo):
        self.eos_token_id = info.eos_token_ids[0]
        self.bos_token_id = None
        padding = info.vocab_size - info.num_tokens
        self.tokens = [*info.vocab, *([b""] * padding)]
        self.special_token_ids = sorted(info.special_token_ids | set(range(info.num_tokens, info.vocab_size)))
        self._encode = info.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # tells TokenizerWrapper to pass str, never partial UTF-8 bytes
        return self._encode(text)


class LLGuidanceGrammar(Grammar):
    __slots__ = ("_eos", "_eos_after_stop", "_matcher", "_words", "backend")
    # validate_tokens takes ~3 µs where a fill walks the token trie (~70 µs on cl100k); the two agreed on all
    # of 58k tokens checked across JSONSchemaBench states (tests/structured/test_llguidance_checks.py).
    checks_tokens_cheaply = True

    def __init__(self, matcher: Any, backend: LLGuidanceBackend, eos_after_stop: int = 0):
        self._matcher = matcher
        self.backend = backend
        self._words = backend.words
        self._eos = backend.eos
        self._eos_after_stop = eos_after_stop

    @property
    def matcher(self) -> Any:
        return self._matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        ids = list(token_ids)
        m = self._matcher
        n = 0 if m.is_stopped() else m.try_consume_tokens(ids)
        if n == len(ids):
            return not m.is_error()
        # Once stopped, llguidance takes only EOS, through consume_token, and keeps no state for it (so a
        # rollback would undo the token before): such EOS are counted here instead.
        if m.is_stopped() and all(t in self._eos for t in ids[n:]):
            self._eos_after_stop += len(ids) - n
            return True
        if n:
            m.rollback(n)
        return False

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        ids = list(token_ids)
        if self._matcher.is_stopped():
            return next((k for k, t in enumerate(ids) if t not in self._eos), len(ids))
        return self._matcher.validate_tokens(ids)

    def rollback(self, num_tokens: int) -> None:
        undone = min(num_tokens, self._eos_after_stop)
        self._eos_after_stop -= undone
        if num_tokens > undone:
            self._matcher.rollback(num_tokens - undone)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if bitmask.shape[1] != self._words:
            raise ValueError(
                f"bitmask rows have {bitmask.shape[1]} words, the vocabulary needs {self._words}"
            )
        self._matcher.unsafe_compute_mask_ptr(
            bitmask.data_ptr() + row * bitmask.stride(0) * 4, self._words * 4
        )

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def find_jump_forward(self) -> list[int]:
        if self._matcher.is_stopped():
            return []
        return list(self._matcher.compute_ff_tokens())

    def forced_bytes(self) -> bytes | None:
        if self._matcher.is_stopped():
            return b""
        return bytes(self._matcher.compute_ff_bytes())

    def reset(self) -> None:
        self._matcher.reset()
        self._eos_after_stop = 0

    def clone(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self._matcher.deep_copy(), self.backend, self._eos_after_stop)


class LLGuidanceBackend(StructuredBackend):
    name = "llguidance"
    kinds = frozenset({"json_schema", "json_object", "regex", "grammar", "choice"})
    schema_support = LLGUIDANCE_SUPPORT

    def __init__(self, tokenizer: TokenizerInfo):
        super().__init__(tokenizer)
        import llguidance

        self._ll = llguidance
        self._lltok = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_TokenizerAdapter(tokenizer)),
            n_vocab=tokenizer.vocab_size,
            eos_token=list(tokenizer.eos_token_ids),
        )
        self.words = (tokenizer.vocab_size + 31) // 32
        self.eos = frozenset(tokenizer.eos_token_ids)
        self._executor: Any = None
        self._executor_lock = threading.Lock()

    def grammar_source(self, spec: StructuredSpec) -> str:
        """The llguidance grammar (serialized) for a spec."""
        matcher = self._ll.LLMatcher
        if spec.kind in ("json_schema", "json_object"):
            return matcher.grammar_from_json_schema(spec.schema(), overrides=json_options(spec))
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            return matcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in spec.choices()))
        return self._ll.grammar_from("lark" if spec.syntax == "lark" else "ebnf", spec.text)

    def _compile(self, spec: StructuredSpec) -> Grammar:
        source = self.grammar_source(spec)
        matcher = self._ll.LLMatcher(self._lltok, source, log_level=0)
        if matcher.is_error():
            raise _refusal(matcher.get_error(), spec)
        return LLGuidanceGrammar(matcher, self)

    def fill_bitmask_batch(self, items: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        if not items:
            return
        if bitmask.shape[1] != self.words or not bitmask.is_contiguous():
            raise ValueError(
                f"bitmask must be contiguous with {self.words} words a row, got {tuple(bitmask.shape)}"
            )
        if len(items) < _PARALLEL_MIN_ROWS or usable_cpus() < _PARALLEL_MIN_CPUS:
            for grammar, row in items:
                grammar.fill_bitmask(bitmask, row)
            return
        pairs = [(g._matcher, row) for g, row in items]  # type: ignore[attr-defined]
        # One Rust call fills every row on llguidance's own threads, without the GIL.
        self._get_executor().unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), self.words * 4, bitmask.shape[0]
        )

    def _get_executor(self) -> Any:
        with self._executor_lock:
            if self._executor is None:
                self._executor = self._ll.LLExecutor()
            return self._executor


def json_options(spec: StructuredSpec) -> dict[str, Any]:
    """llguidance's JSON options for `spec` (separators, whitespace): also what the tool grammar's JSON answer
    branch is written under."""
    options: dict[str, Any] = {
        "item_separator": ",",
        "key_separator": ":",
        "coerce_one_of": False,
        "lenient": False,
        "whitespace_flexible": spec.whitespace == "flexible",
    }
    if spec.whitespace == "flexible":
        options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{0,{spec.max_whitespace}}}"
    return options


def _lark_string(text: str) -> str:
    # Lark string literals take JSON-style escapes.
    return json.dumps(text, ensure_ascii=False)


def _refusal(message: str, spec: StructuredSpec) -> UnsupportedSchemaError:
    text = " ".join(message.split())
    if spec.kind not in ("json_schema", "json_object"):
        return UnsupportedSchemaError(text[:500], backend="llguidance")
    schema = spec.schema()
    keyword: str | None = None
    path: str | None = None
    if m := _UNIMPLEMENTED.search(text):
        keyword = m.group(1)
    elif m := _UNKNOWN_FORMAT.search(text):
        keyword = "format"
        path = find_keyword(schema, "format", m.group(1))
    else:
        for pattern, kw in _ERRORS:
            if pattern.search(text):
                keyword = kw
                break
        if keyword == "minProperties" and find_keyword(schema, "minProperties") is None:
            keyword = "maxProperties"
        if keyword == "pattern" and (regex := _quoted_regex(text)) is not None:
            path = find_keyword(schema, "pattern", regex)
            if path is None and find_keyword(schema, "patternProperties") is not None:
                keyword = "patternProperties"
    if keyword == "$ref" and "sibling keys" in text:
        # The culprit is a $ref with keywords beside it: preferably one pointing at the named target.
        # (or an anyOf/oneOf/allOf of $refs with keywords beside it, which must be intersected with them).
        m = re.search(r"sibling keys are not supported: \S*?(#\S*)", text)
        with_siblings = [
            (p, _refs(node)) for p, node in iter_subschemas(schema) if _refs(node) and _beside(node)
        ]
        named = [p for p, refs in with_siblings if m and m.group(1) in refs]
        path = (named or [p for p, _ in with_siblings] or [None])[0]
        if path is None:
            keyword = None
    if keyword is not None and path is None:
        path = find_keyword(schema, keyword)
    if keyword is not None and path is None:
        keyword = None
    return UnsupportedSchemaError(text[:500], keyword=keyword, path=path, backend="llguidance")


def _quoted_regex(text: str) -> str | None:
    m = re.search(r"regex /(.*?)/(?:\s|$)", text) or re.search(r"parse error:\s*(.*?)\s*\^", text)
    return m.group(1) if m else None


_APPLICATORS = ("anyOf", "oneOf", "allOf")


def _refs(node: dict[str, Any]) -> set[str]:
    """The references a node makes directly or through the branches of an applicator."""
    refs = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
    for key in _APPLICATORS:
        for branch in node.get(key) or ():
            if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                refs.add(branch["$ref"])
    return refs


def _beside(node: dict[str, Any]) -> bool:
    return any(k in ASSERTION_KEYWORDS and k != "$ref" and k not in _APPLICATORS for k in node) or (
        "$ref" in node and any(k in node for k in _APPLICATORS)
    )
