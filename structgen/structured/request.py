"""What the engine holds per structured request, and the batch logits processor it installs.

`StructuredRequest` follows one request: the compile future (`ready` is what the scheduler polls while the
request waits in WAITING_FOR_GRAMMAR), then its grammar; sampled tokens go through `accept` (a rejected
token raises: the mask and the matcher disagree, a bug that must not pass silently), forced tokens come from
`jump_forward`, and the finished text gets `validate`d, with `should_retry` telling a relaxed request
to sample again. `StructuredLogitsProcessor` is the engine's `logits_processor(logits, seqs)`: it fills the
rows of the constrained sequences (started early with `prepare`, so the fill overlaps the model forward)
and masks only those rows, or, deferring to the sampler, hands over a `TokenMask` in which rows of grammars
that check single tokens cheaply are left unfilled until the sampler needs them whole.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from structgen.engine.token_mask import TokenMask, needs_masked_distribution
from structgen.structured.backend import Grammar
from structgen.structured.bitmask import apply_token_bitmask_
from structgen.structured.closing import ByteTokens
from structgen.structured.errors import GrammarRejectedTokenError, StructuredOutputError
from structgen.structured.finishing import Advance, Finisher, emits_json, pattern_hints
from structgen.structured.manager import FillFailures, StructuredOutputManager
from structgen.structured.pick_hints import PickHints
from structgen.structured.select import CompiledSpec
from structgen.structured.spec import StructuredOutputsParams, StructuredSpec
from structgen.structured.validate import ValidationResult, validate_output


class StructuredRequest:
    def __init__(self, manager: StructuredOutputManager, params: StructuredOutputsParams):
        self.params = params
        self.spec = params.to_spec()
        self.future: Future[CompiledSpec] = manager.submit(self.spec)
        self.max_retries = manager.config.max_validation_retries
        self.compiled: CompiledSpec | None = None
        self.grammar: Grammar | None = None
        self.retries = 0
        self.num_forced_tokens = 0
        self.validation: ValidationResult | None = None
        self.finisher = _finisher(manager, params, self.spec)
        self.pick_hints = PickHints()

    @property
    def position(self) -> int | None:
        """The kind of position the output is at (the innermost JSON value open; None without a JSON view),
        which `pick_hints` are kept by."""
        return self.finisher.scanner.innermost if self.finisher is not None else None

    @property
    def initial_need(self) -> int | None:
        """Tokens of the grammar's shortest complete output, when the budget closer knows it (after `start`)."""
        closer = self.finisher.closer if self.finisher is not None else None
        return closer.need if closer is not None else None

    def ready(self) -> bool:
        """The compile finished (successfully or not): the scheduler may call `start`."""
        return self.future.done()

    def start(self) -> Grammar:
        """The request's grammar; raises the compile error (UnsupportedSchemaError, CompileTimeoutError...)."""
        if self.grammar is None:
            self.compiled = compiled = self.future.result()
            self.grammar = compiled.new_grammar()
            if self.finisher is not None:
                self.finisher.prepare((compiled.backend, *compiled.spec.key), compiled.new_grammar)
        return self.grammar

    def fork(self) -> StructuredRequest:
        """An independent copy for a sibling sample (n > 1): same compiled spec, its own grammar state."""
        child = copy.copy(self)
        if self.grammar is not None:
            child.grammar = self.grammar.clone()
        if self.finisher is not None:
            child.finisher = self.finisher.copy()
        child.pick_hints = PickHints(dict(self.pick_hints.rates))
        return child

    def accept(self, token_ids: Sequence[int]) -> None:
        grammar = self.start()
        if not grammar.accept_tokens(token_ids):
            raise GrammarRejectedTokenError(
                f"the {self.compiled.backend if self.compiled else '?'} grammar rejected sampled tokens "
                f"{list(token_ids)} although the mask allowed them"
            )
        if self.finisher is not None:
            self.finisher.entered(list(token_ids))

    def advance(self, token_id: int, *, left: int | None, jump_forward: bool = True) -> Advance:
        """Accept a sampled (non-EOS) token and say what follows it: forced tokens, the end of a looping value,
        or, near the budget, the closing completion in its place (`finishing.Finisher`). `left`: the tokens
        the sequence may still take after this one (None: unlimited)."""
        if self.finisher is None:
            self.accept([token_id])
            return Advance(True, self.jump_forward() if jump_forward else [])
        grammar = self.start()
        step = self.finisher.advance(grammar, token_id, left=left, jump_forward=jump_forward)
        self.num_forced_tokens += len(step.tokens)
        return step

    @property
    def closed_at_budget(self) -> bool:
        return self.finisher is not None and self.finisher.closed_at_budget

    def withdraw_closing(self) -> None:
        """The closed output failed validation (a relaxed grammar): it is reported as cut, not closed."""
        if self.finisher is not None:
            self.finisher.closed_at_budget = False

    def jump_forward(self) -> list[int]:
        """Forced tokens, already accepted by the grammar: append them to the sequence without sampling."""
        grammar = self.start()
        forced = grammar.find_jump_forward()
        if forced:
            self.accept(forced)
            self.num_forced_tokens += len(forced)
        return forced

    def is_terminated(self) -> bool:
        """Nothing may follow: the grammar is complete, or the output was closed at its budget."""
        return self.grammar is not None and (self.grammar.is_terminated() or self.closed_at_budget)

    def validate(self, text: str) -> ValidationResult:
        """Check the finished output against what was asked (the original schema, before any rewrite)."""
        self.validation = validate_output(self.spec, text)
        return self.validation

    @property
    def holds_back_output(self) -> bool:
        """A relaxed grammar's output may be resampled after validation, so nothing of it is streamed before
        it is final: a client must never see text that a retry then takes back."""
        return self.compiled is not None and self.compiled.needs_validation

    def should_retry(self) -> bool:
        """An output of a relaxed grammar failed validation and retries remain: sample again (new seed)."""
        return (
            self.compiled is not None
            and self.compiled.needs_validation
            and self.validation is not None
            and not self.validation.valid
            and self.retries < self.max_retries
        )

    def restart(self) -> None:
        """Start a retry from the initial grammar state."""
        if self.grammar is None:
            raise StructuredOutputError("restart before start")
        self.retries += 1
        self.grammar.reset()
        self.validation = None
        if self.finisher is not None:
            self.finisher.reset()

    def failed_strict(self) -> bool:
        """Strict requests fail, instead of returning a flagged output, when the final output is invalid."""
        return self.params.strict and self.validation is not None and not self.validation.valid

    def report(self) -> dict[str, Any]:
        """How this request was served, for metrics and the output."""
        c = self.compiled
        return {
            "backend": c.backend if c else None,
            "path": c.serving_path if c else None,
            # a restriction says what it leaves out (the recursion depth: outputs nest no deeper)
            "changes": [
                f"{ch.kind} {ch.keyword} at {ch.path}" + (f" ({ch.note})" if ch.kind == "restrict" else "")
                for ch in c.changes
            ]
            if c
            else [],
            "retries": self.retries,
            "forced_tokens": self.num_forced_tokens,
            "valid": None if self.validation is None else self.validation.valid,
            "error": None if self.validation is None else self.validation.error,
            "closed_at_budget": self.closed_at_budget,
            "loops_ended": self.finisher.loops_ended if self.finisher is not None else 0,
        }


class StructuredLogitsProcessor:
    """`logits_processor(logits, seqs)` for the engine: masks the rows whose sequence has a grammar.

    Call `prepare(seqs)` before the model forward to fill the mask on the mask thread meanwhile; `__call__`
    then waits for it (or, given other sequences than were prepared, fills the mask itself).
    """

    def __init__(
        self,
        manager: StructuredOutputManager,
        grammar_of: Callable[[Any], Grammar | None],
        *,
        defer: bool = False,
        also_allowed: Callable[[Any], int | None] | None = None,
    ):
        self.manager = manager
        self.grammar_of = grammar_of
        # A token a row may take besides its grammar's, or None (a reasoning model's opening marker, before its
        # first token decides between reasoning and answering under the grammar).
        self.also_allowed = also_allowed
        self._extra: dict[int, int] = {}  # this step's rows with such a token
        # Hand the mask to the sampler (a `TokenMask`) instead of applying it: the sampler masks only the
        # rows whose pick the mask would change.
        self.defer = defer
        self._bitmask = manager.allocate_bitmask(64)
        self._pending: tuple[list[Any], list[tuple[Grammar, int]], list[int], Future[FillFailures]] | None = (
            None
        )
        # Sequences whose grammar raised while filling the last mask; the engine fails them (`take_failures`).
        self._failures: list[tuple[Any, Exception]] = []
        # The last step's sequences, deferred mask and each constrained row's position (see `pick_hints`).
        self._last: tuple[list[Any], TokenMask, dict[int, int | None]] | None = None
        self._positions: dict[int, int | None] = {}  # this step's, by row
        self._hinted: set[int] = set()  # ids of this step's sequences to mask first (see TokenMask)

    def prepare(self, seqs: Sequence[Any]) -> None:
        self._settle()
        items = self._items(seqs)
        last, self._last = self._last, None
        if last is not None:
            _learn_hints(*last)
        # Rows whose request's lazy picks are mostly rejected where it now stands are hinted (`pick_hints`).
        self._positions, self._hinted = {}, set()
        for _, row in items:
            request = getattr(seqs[row], "structured", None)
            if request is not None:
                position = self._positions[row] = request.position
                if request.pick_hints.hinted(position):
                    self._hinted.add(id(seqs[row]))
        self._extra = {}
        if self.also_allowed is not None:
            for _, row in items:
                token = self.also_allowed(seqs[row])
                if token is not None:
                    self._extra[row] = token
        ahead, deferred = self._split_deferred(seqs, items)
        future = self.manager.fill_bitmask_async(ahead, self._bitmask) if ahead else _done()
        self._pending = (list(seqs), items, deferred, future)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[Any]) -> TokenMask | None:
        pending = self._pending
        if (
            pending is None
            or len(pending[0]) != len(seqs)
            or any(a is not b for a, b in zip(pending[0], seqs, strict=True))
        ):
            self.prepare(seqs)
            pending = self._pending
        assert pending is not None
        self._pending = None
        seqs_, items, deferred, future = pending
        rows = [row for _, row in items]
        failures = future.result()
        if failures:
            # Those rows go unmasked (their sample is discarded) and their requests fail after this step.
            failed = {row for row, _ in failures}
            self._failures.extend((seqs_[row], error) for row, error in failures)
            rows = [row for row in rows if row not in failed]
        if not rows:
            return None
        for row, token in self._extra.items():
            if row not in deferred:
                _allow(self._bitmask, row, token)
        if self.defer:
            grammars = {row: grammar for grammar, row in items}
            mask = TokenMask(
                bitmask=self._bitmask,
                rows=rows,
                eager=[r for r in rows if id(seqs[r]) in self._hinted],
                unfilled={
                    row: self._token_check(seqs_[row], grammars[row], self._extra.get(row))
                    for row in deferred
                },
                fill=lambda missing: self._fill_now(seqs_, grammars, missing),
            )
            self._last = (list(seqs), mask, self._positions)
            return mask
        apply_token_bitmask_(logits, self._bitmask, rows=rows)
        return None

    def _split_deferred(
        self, seqs: Sequence[Any], items: list[tuple[Grammar, int]]
    ) -> tuple[list[tuple[Grammar, int]], list[int]]:
        """(rows to fill now, on the mask thread; rows left unfilled). A deferred row's pick is checked against
        its grammar alone (a few µs where filling the row walks the vocabulary) and the row is filled only if
        the sampler needs it whole: rows of grammars that check tokens cheaply, picked lazily, not hinted."""
        if not self.defer:
            return items, []
        ahead, deferred = [], []
        for grammar, row in items:
            seq = seqs[row]
            params = getattr(seq, "params", None)
            lazy = params is not None and not needs_masked_distribution(params)
            if grammar.checks_tokens_cheaply and lazy and id(seq) not in self._hinted:
                deferred.append(row)
            else:
                ahead.append((grammar, row))
        return ahead, deferred

    def _token_check(self, seq: Any, grammar: Grammar, extra: int | None = None) -> Callable[[int], bool]:
        validate = grammar.validate_tokens

        def check(token: int) -> bool:
            if token == extra:
                return True
            try:
                return validate((token,)) == 1
            except Exception as error:  # a grammar bug: its request fails after this step, the batch goes on
                self._failures.append((seq, error))
                return True

        return check

    def _fill_now(self, seqs: list[Any], grammars: dict[int, Grammar], rows: list[int]) -> None:
        """Fill deferred rows the sampler needs whole. A row whose grammar raises allows everything for this
        step; its request fails after the step, like a failed fill ahead."""
        for row, error in self.manager.fill_bitmask([(grammars[row], row) for row in rows], self._bitmask):
            self._bitmask[row].fill_(-1)
            self._failures.append((seqs[row], error))
        for row in rows:
            if row in self._extra:
                _allow(self._bitmask, row, self._extra[row])

    def take_failures(self) -> list[tuple[Any, Exception]]:
        """(sequence, error) for each sequence whose grammar failed to fill its mask since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _settle(self) -> None:
        # A fill still writing into the bitmask must finish before the bitmask is reused.
        if self._pending is not None:
            self._pending[3].result()
            self._pending = None

    def _items(self, seqs: Sequence[Any]) -> list[tuple[Grammar, int]]:
        if len(seqs) > self._bitmask.shape[0]:
            self._bitmask = self.manager.allocate_bitmask(2 * len(seqs))
        items = []
        for row, seq in enumerate(seqs):
            grammar = self.grammar_of(seq)
            if grammar is not None:
                items.append((grammar, row))
        return items


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set `token`'s bit in `bitmask[row]` (int32 words, bit i of word w is token 32 * w + i)."""
    word, bit = divmod(token, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def _learn_hints(seqs: list[Any], mask: TokenMask, positions: dict[int, int | None]) -> None:
    """Feed the last step's outcome to each request's pick hints: rows picked lazily, whether the mask rejected
    the pick (after drawing again); rows hinted, that they were."""
    eager, rejected = set(mask.eager), set(mask.rejected)
    for row, position in positions.items():
        request = getattr(seqs[row], "structured", None)
        if request is None or row not in mask.rows:
            continue
        if row in eager:
            request.pick_hints.picked_hinted(position)
        else:
            request.pick_hints.picked_lazily(position, rejected=row in rejected)


def _finisher(
    manager: StructuredOutputManager, params: StructuredOutputsParams, spec: StructuredSpec
) -> Finisher | None:
    """The request's closing and loop guard, as the request asks or else by the engine's defaults."""
    config = manager.config
    json_output = emits_json(spec)
    close = (
        params.close_at_budget
        if params.close_at_budget is not None
        else json_output and config.close_at_budget
    )
    guard = params.loop_guard if params.loop_guard is not None else json_output and config.loop_guard
    if not close and not guard and not json_output:
        # (A JSON output keeps its scanner even with both off: where it stands is what its pick hints are kept
        # by, and a seeded request must draw the same tokens whether closing is on or off.)
        return None
    return Finisher(
        ByteTokens.of(manager.tokenizer),
        close=close,
        guard=guard,
        max_number_digits=config.max_number_digits,
        hints=pattern_hints(spec),
    )


def _done() -> Future[FillFailures]:
    future: Future[FillFailures] = Future()
    future.set_result([])
    return future
