"""xgrammar adapter: a pushdown automaton with precomputed context-independent token masks.

xgrammar compiles nearly every schema but silently loosens some keywords, so `XGRAMMAR_SUPPORT` (checked
in `StructuredBackend.compile` before compiling) refuses those; the relaxation step then widens them
explicitly and the outputs are validated. `strict_mode=False` keeps JSON Schema's own meaning for objects
and arrays (xgrammar's strict mode forbids unlisted properties and items).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from structgen.structured.backend import Grammar, StructuredBackend, forced_tokens
from structgen.structured.bitmask import fill_allow_only
from structgen.structured.spec import StructuredSpec
from structgen.structured.support import XGRAMMAR_SUPPORT
from structgen.structured.tokenizer_info import TokenizerInfo


class XGrammarGrammar(Grammar):
    __slots__ = ("_ended", "_matcher", "backend")

    def __init__(self, matcher: Any, backend: XGrammarBackend):
        self._matcher = matcher
        self.backend = backend
        # Mirrors matcher.is_terminated() (which costs a native call): the mask fill is on the hot path.
        self._ended = matcher.is_terminated()

    @property
    def matcher(self) -> Any:
        return self._matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for done, t in enumerate(token_ids):
            if not self._matcher.accept_token(int(t)):
                if done:
                    self._matcher.rollback(done)
                    self._ended = self._matcher.is_terminated()
                return False
        self._ended = self._matcher.is_terminated()
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self._ended = self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._ended:  # xgrammar refuses to compute a mask once it has accepted EOS
            fill_allow_only(bitmask, row, self.backend.tokenizer.eos_token_ids)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._ended

    def find_jump_forward(self) -> list[int]:
        if self._ended:
            return []
        forced = self._matcher.find_jump_forward_string()
        ids = forced_tokens(self.backend.tokenizer, forced.encode("utf-8"), may_continue=True)
        # The canonical tokens must also be a path through the grammar (they are, unless a token boundary
        # falls where the grammar's lexer would not split).
        if ids and not self.accept_tokens(ids):
            return []
        self.rollback(len(ids))
        return ids

    def reset(self) -> None:
        self._matcher.reset()
        self._ended = False

    def clone(self) -> XGrammarGrammar:
        return XGrammarGrammar(self._matcher.fork(), self.backend)


class XGrammarBackend(StructuredBackend):
    name = "xgrammar"
    kinds = frozenset({"json_schema", "json_object", "regex", "grammar", "choice"})
    schema_support = XGRAMMAR_SUPPORT

    def __init__(self, tokenizer: TokenizerInfo, *, max_threads: int = 2):
        super().__init__(tokenizer)
        import xgrammar

        self._xgr = xgrammar
        special = tokenizer.special_token_ids
        # Empty entries are never allowed; the EOS ids are allowed as stop tokens where the grammar ends.
        vocab = [b"" if i in special else tok for i, tok in enumerate(tokenizer.vocab)]
        info = xgrammar.TokenizerInfo(
            vocab,
            xgrammar.VocabType.RAW,
            vocab_size=tokenizer.vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids),
        )
        # Our manager caches compiled grammars; xgrammar's own cache would only duplicate them.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._batch: Any = None

    def _compile(self, spec: StructuredSpec) -> Grammar:
        c = self._compiler
        if spec.kind in ("json_schema", "json_object"):
            flexible = spec.whitespace == "flexible"
            compiled = c.compile_json_schema(
                json.dumps(spec.schema(), ensure_ascii=False),
                any_whitespace=flexible,
                separators=(",", ":"),
                strict_mode=False,
                max_whitespace_cnt=spec.max_whitespace if flexible else None,
            )
        elif spec.kind == "regex":
            compiled = c.compile_regex(spec.text)
        elif spec.kind == "choice":
            compiled = c.compile_grammar("root ::= " + " | ".join(_ebnf_string(s) for s in spec.choices()))
        elif spec.syntax == "lark":
            compiled = c.compile_lark(spec.text)
        else:
            compiled = c.compile_grammar(spec.text)
        return XGrammarGrammar(self._xgr.GrammarMatcher(compiled), self)

    def fill_bitmask_batch(self, items: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        matchers, rows = [], []
        for grammar, row in items:
            if grammar._ended:  # type: ignore[attr-defined]
                fill_allow_only(bitmask, row, self.tokenizer.eos_token_ids)
            else:
                matchers.append(grammar._matcher)  # type: ignore[attr-defined]
                rows.append(row)
        if not matchers:
            return
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher(max_threads=2)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def _ebnf_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
