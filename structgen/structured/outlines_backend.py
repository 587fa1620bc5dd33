"""outlines-core adapter: the spec becomes one regex, compiled into a token-level DFA index.

Index construction is slow (about a second on a 100k vocabulary, far more on large schemas), so `auto`
tries it last; its JSON Schema → regex translation ignores several keywords, which `OUTLINES_SUPPORT`
refuses up front. Lark/EBNF grammars are out of its reach.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from structgen.structured.backend import Grammar, StructuredBackend
from structgen.structured.bitmask import allow_tokens, fill_allow_only
from structgen.structured.spec import StructuredSpec
from structgen.structured.support import OUTLINES_SUPPORT
from structgen.structured.tokenizer_info import TokenizerInfo

_MAX_ROLLBACK = 256
_MAX_FORCED = 64


class OutlinesGrammar(Grammar):
    __slots__ = ("_eos", "_guide", "_history", "_index", "_terminated", "backend")

    def __init__(self, index: Any, backend: OutlinesBackend):
        self._index = index
        self.backend = backend
        self._guide = backend.oc.Guide(index, max_rollback=_MAX_ROLLBACK)
        self._eos = backend.eos_ids
        self._history: list[int] = []
        # outlines-core allows EOS in final states but cannot advance on it: EOS is tracked here.
        self._terminated = False

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        ids = [int(t) for t in token_ids]
        if self._terminated:
            return not ids
        body = ids[:-1] if ids and ids[-1] in self._eos else ids
        if any(t in self._eos for t in body):
            return False
        if body and not self._guide.accepts_tokens(body):
            return False
        for t in body:
            self._guide.advance(t, False)
        self._history.extend(body)
        if len(body) < len(ids):
            if not self._guide.is_finished():
                self.rollback(len(body))
                return False
            self._terminated = True
            self._history.append(ids[-1])
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens, only {len(self._history)} accepted")
        if self._terminated:
            self._terminated = False
            self._history.pop()
            num_tokens -= 1
        if num_tokens:
            self._guide.rollback_state(num_tokens)
            del self._history[-num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            fill_allow_only(bitmask, row, sorted(self._eos))
            return
        words = bitmask.shape[1]
        self._guide.write_mask_into(bitmask.data_ptr() + row * bitmask.stride(0) * 4, words, 4)
        if len(self._eos) > 1 and self._guide.is_finished():
            # outlines-core knows one EOS id; the others end generation just as well.
            allow_tokens(bitmask, row, sorted(self._eos))

    def is_terminated(self) -> bool:
        return self._terminated

    def find_jump_forward(self) -> list[int]:
        # Token-level forcing only: while exactly one non-EOS token is allowed, it is forced.
        forced: list[int] = []
        while not self._terminated and len(forced) < _MAX_FORCED:
            allowed = self._guide.get_tokens()
            if len(allowed) != 1 or allowed[0] in self._eos:
                break
            self._guide.advance(allowed[0], False)
            forced.append(allowed[0])
        if forced:
            self._guide.rollback_state(len(forced))
        return forced

    def reset(self) -> None:
        self._guide.reset()
        self._history.clear()
        self._terminated = False

    def clone(self) -> OutlinesGrammar:
        copy = OutlinesGrammar(self._index, self.backend)
        if self._history and not copy.accept_tokens(self._history):
            raise RuntimeError("outlines-core guide could not replay its own history")
        return copy


class OutlinesBackend(StructuredBackend):
    name = "outlines"
    kinds = frozenset({"json_schema", "regex", "choice"})
    schema_support = OUTLINES_SUPPORT

    def __init__(self, tokenizer: TokenizerInfo):
        super().__init__(tokenizer)
        import outlines_core

        self.oc = outlines_core
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for i, tok in enumerate(tokenizer.vocab):
            if tok and i not in tokenizer.special_token_ids:
                by_bytes.setdefault(tok, []).append(i)
        self._vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_ids[0], by_bytes)

    def regex_for(self, spec: StructuredSpec) -> str:
        if spec.kind == "json_schema":
            ws = "" if spec.whitespace == "compact" else f"[ \\n\\t\\r]{{0,{spec.max_whitespace}}}"
            return self.oc.json_schema.build_regex_from_schema(
                json.dumps(spec.schema(), ensure_ascii=False), ws
            )
        if spec.kind == "choice":
            # outlines-core's automaton takes alternatives leftmost-first: "Java|JavaScript" would never
            # reach "JavaScript", so longer choices go first.
            ordered = sorted(spec.choices(), key=len, reverse=True)
            return "(" + "|".join(_escape(c) for c in ordered) + ")"
        return spec.text

    def _compile(self, spec: StructuredSpec) -> Grammar:
        index = self.oc.Index(self.regex_for(spec), self._vocabulary)
        return OutlinesGrammar(index, self)


def _escape(text: str) -> str:
    # Only metacharacters: every regex dialect involved reads these escapes the same way.
    return "".join("\\" + ch if ch in _META else ch for ch in text)


_META = frozenset("\\.+*?()|[]{}^$#&-~")
