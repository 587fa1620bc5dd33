"""The two interfaces every grammar library is adapted to (vLLM v1's shape).

`StructuredBackend` is engine-level: one per (library, tokenizer), it compiles a canonical spec.
`Grammar` is request-level matcher state: it accepts the sampled tokens, writes its row of the batch
bitmask, rolls back, and offers jump-forward tokens where only one continuation is possible.
"""

from __future__ import annotations

import bisect
import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from structgen.structured.errors import StructuredOutputError, UnsupportedSchemaError
from structgen.structured.spec import SpecKind, StructuredSpec
from structgen.structured.support import SchemaSupport, Unsupported
from structgen.structured.tokenizer_info import TokenizerInfo

BACKEND_NAMES = ("llguidance", "xgrammar", "outlines")
_MODULES = {
    "llguidance": ("structgen.structured.llguidance_backend", "LLGuidanceBackend"),
    "xgrammar": ("structgen.structured.xgrammar_backend", "XGrammarBackend"),
    "outlines": ("structgen.structured.outlines_backend", "OutlinesBackend"),
}


class Grammar(ABC):
    """Matcher state of one request. Not thread-safe: one request's grammar is used by one thread at a time."""

    backend: StructuredBackend  # the compiler it came from (batched mask fills group rows by it)
    # Whether `validate_tokens` of one token is cheap next to `fill_bitmask` and agrees with it exactly, so the
    # engine may check a sampled token instead of filling the row first (see `TokenMask.unfilled`).
    checks_tokens_cheaply: bool = False

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by `token_ids`; all or nothing: on False the state is unchanged."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (padded-vocabulary width; padding masked)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the output is complete: EOS was accepted, or nothing but EOS could follow."""

    @abstractmethod
    def find_jump_forward(self) -> list[int]:
        """Tokens the grammar forces next (canonically tokenized), to append without sampling; may be []."""

    def forced_bytes(self) -> bytes | None:
        """The bytes the grammar forces next, where the backend tells them without tokenizing (None: use
        `find_jump_forward`)."""
        return None

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state."""

    @abstractmethod
    def clone(self) -> Grammar:
        """An independent copy in the current state (the compile cache hands out copies of a fresh one)."""

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` would be accepted, without changing the state."""
        n = 0
        for t in token_ids:
            if not self.accept_tokens([t]):
                break
            n += 1
        if n:
            self.rollback(n)
        return n


class StructuredBackend(ABC):
    """Compiles canonical specs into grammars for one tokenizer."""

    name: ClassVar[str]
    kinds: ClassVar[frozenset[SpecKind]]
    schema_support: ClassVar[SchemaSupport]

    def __init__(self, tokenizer: TokenizerInfo):
        self.tokenizer = tokenizer

    def compile(self, spec: StructuredSpec) -> Grammar:
        """Compile `spec`; a keyword this backend would not enforce exactly raises UnsupportedSchemaError
        (naming it and its JSON path) instead of compiling a looser grammar."""
        if spec.kind not in self.kinds:
            raise UnsupportedSchemaError(f"{spec.kind} specs are not supported", backend=self.name)
        if spec.kind == "json_schema":
            found = self.find_unsupported(spec.schema())
            if found:
                first = found[0]
                raise UnsupportedSchemaError(
                    first.reason, keyword=first.keyword, path=first.path, backend=self.name
                )
        try:
            return self._compile(spec)
        except StructuredOutputError:
            raise
        except Exception as e:  # a library's own parse/compile error
            raise UnsupportedSchemaError(_one_line(e), backend=self.name) from e

    def find_unsupported(self, schema: Any) -> list[Unsupported]:
        """Keywords of a (normalized) schema this backend cannot enforce exactly; [] if none."""
        return self.schema_support.find_unsupported(schema)

    @abstractmethod
    def _compile(self, spec: StructuredSpec) -> Grammar: ...

    def fill_bitmask_batch(self, items: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        """Fill the rows of many grammars of this backend (overridden where the library batches natively)."""
        for grammar, row in items:
            grammar.fill_bitmask(bitmask, row)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def create_backend(name: str, tokenizer: TokenizerInfo) -> StructuredBackend:
    """Instantiate a backend by name; its library is imported only now."""
    if name not in _MODULES:
        raise ValueError(
            f"unknown structured-output backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    module, cls = _MODULES[name]
    try:
        backend_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise StructuredOutputError(f"structured-output backend {name!r} is not installed: {e}") from e
    return backend_cls(tokenizer)


def forced_tokens(tokenizer: TokenizerInfo, forced: bytes, *, may_continue: bool) -> list[int]:
    """Canonical tokens for forced output bytes.

    The text is tokenized as the model's tokenizer would; if more output can follow, the last token is
    dropped when some vocabulary token extends it, since the sampled continuation may merge with it.
    """
    if not forced:
        return []
    try:
        text = forced.decode("utf-8")
    except UnicodeDecodeError:
        return []
    ids = tokenizer.encode(text)
    if any(i in tokenizer.special_token_ids for i in ids):
        return []
    if may_continue and ids and _extendable(tokenizer, ids[-1]):
        ids = ids[:-1]
    return ids


_SORTED_VOCAB: dict[str, list[bytes]] = {}


def _extendable(tokenizer: TokenizerInfo, token_id: int) -> bool:
    """Some ordinary token starts with this token's bytes and is longer."""
    ordered = _SORTED_VOCAB.get(tokenizer.tokenizer_id)
    if ordered is None:
        special = tokenizer.special_token_ids
        ordered = sorted(tok for i, tok in enumerate(tokenizer.vocab) if tok and i not in special)
        _SORTED_VOCAB[tokenizer.tokenizer_id] = ordered
    tok = tokenizer.vocab[token_id]
    k = bisect.bisect_right(ordered, tok)
    return k < len(ordered) and ordered[k].startswith(tok)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:500] if text else type(e).__name__
