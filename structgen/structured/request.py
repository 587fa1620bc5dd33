"""What the engine holds per structured request.

`StructuredRequest` follows one request: the compile future (`ready` is what the scheduler polls while the
request waits in WAITING_FOR_GRAMMAR), then its grammar; sampled tokens go through `accept` (a rejected
token raises: the mask and the matcher disagree, a bug that must not pass silently), forced tokens come from
`jump_forward`, and the finished text gets `validate`d, with `should_retry` telling a relaxed request
to sample again. The batch logits processor the engine installs is `logits_processor.StructuredLogitsProcessor`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from structgen.structured.backend import Grammar
from structgen.structured.closing import ByteTokens
from structgen.structured.errors import GrammarRejectedTokenError, StructuredOutputError
from structgen.structured.finishing import Advance, Finisher, emits_json, pattern_hints
from structgen.structured.json_scan import ARRAY, OBJECT, STRING
from structgen.structured.manager import StructuredOutputManager
from structgen.structured.pick_hints import PickHints
from structgen.structured.select import CompiledSpec
from structgen.structured.spec import StructuredOutputsParams, StructuredSpec
from structgen.structured.validate import ValidationResult, validate_output

_BETWEEN_VALUES = (OBJECT, ARRAY)
# Letters that free text takes and few narrower strings do (an enum's values, digits, a date), both cases.
_TEXT_PROBES = b"exQ"


class StructuredRequest:
    def __init__(
        self, manager: StructuredOutputManager, params: StructuredOutputsParams, *, share_hints: bool = True
    ):
        self.params = params
        # Pick hints change which path draws a row (lazily, or among its allowed tokens), so for the same seed
        # the token drawn: a seeded request keeps its own, so that its output depends on it alone (not on the
        # other requests of its compile or the batch's history: preemption, arrival order).
        self.share_hints = share_hints
        self.spec = params.to_spec()
        self.future: Future[CompiledSpec] = manager.submit(self.spec)
        self.max_retries = manager.config.max_validation_retries
        self.compiled: CompiledSpec | None = None
        self.grammar: Grammar | None = None
        self.retries = 0
        self.num_forced_tokens = 0
        self.validation: ValidationResult | None = None
        self.finisher = _finisher(manager, params, self.spec)
        self.pick_hints = PickHints.private()  # the compile's shared one replaces it in `start`
        # A sampled token the grammar took already this step, when the sampler's check of the pick took it
        # (`take_checked`), and the tokens the grammar forces after it (with jump-forward on), found then;
        # `advance` then does not ask the grammar for either again.
        self.checked_token: int | None = None
        self.checked_forced: list[int] | None = None
        self._jump_forward = manager.config.jump_forward
        # The engine's last report of this request and what it was made from (`engine.structured_report`).
        self.last_report: tuple[tuple[Any, ...], Any] | None = None

    @property
    def position(self) -> int | None:
        """The innermost JSON value open (None without a JSON view): whether the output is inside a string, for
        the n-gram proposer. `pick_hints` are kept by the finer `hint_context`."""
        return self.finisher.scanner.innermost if self.finisher is not None else None

    @property
    def hint_context(self) -> int | None:
        """The kind of position `pick_hints` are kept by (None without a JSON view): the member whose value is
        being written (`JsonScanner.member`: a zip code's digits are not a name's letters), and within it,
        between values: the object or array open and the last byte written outside strings (`:` before a value,
        `,` or `{` before a key, `"` or a digit after a value), which tells a structural point from a value's
        start; inside a string: whether the grammar forces its next bytes (a string at its `maxLength` allows
        only its closing quote: narrow), asked of the grammar (~2 µs), and whether it is a key; inside a
        number: that. The first time a value's string stands where nothing is forced, the pick hints are told
        whether that kind of position is open text (`_saw_text`)."""
        scanner = self.finisher.scanner if self.finisher is not None else None
        if scanner is None:
            return None
        kind = scanner.innermost
        if kind in _BETWEEN_VALUES:
            detail = kind << 8 | scanner.after
        elif kind == STRING and self.grammar is not None:
            try:
                forced = bool(self.grammar.forced_bytes())
            except Exception:  # a grammar bug surfaces where its mask is filled; here it only guesses
                forced = False
            # A key is written while its object's last key still stands for the member: told apart here.
            detail = kind << 8 | forced << 1 | scanner.in_key
            if not forced and not scanner.in_key:
                context = hash((detail, scanner.member))
                if context not in self.pick_hints.text and not scanner.escaped:
                    self._saw_text(context)
                return context
        else:
            detail = kind or 0
        # By member, a request's own table too: a zip code's digits and a name's letters filed together made
        # the name's rows filled ahead as if narrow; alone, a request learns each member from its first look.
        return hash((detail, scanner.member))

    def _saw_text(self, context: int) -> None:
        """Tell the pick hints whether this string takes free text: the grammar takes each of a few letters here
        (an enum's string, a pattern of digits, take few of them; ~2 µs a letter, once per kind of position)."""
        assert self.finisher is not None and self.grammar is not None
        by_byte = self.finisher.tokens.by_byte
        letters = [by_byte[b] for b in _TEXT_PROBES if b in by_byte]
        try:
            open_text = len(letters) > 1 and all(self.grammar.validate_tokens((t,)) == 1 for t in letters)
        except Exception:  # a grammar bug surfaces where its mask is filled; here it only guesses
            open_text = False
        self.pick_hints.saw_text(context, open_text=open_text)

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
            if self.share_hints:
                self.pick_hints = compiled.pick_hints  # learnt by every request of this compile
            if self.finisher is not None:
                self.finisher.prepare((compiled.backend, *compiled.spec.key), compiled.new_grammar)
        return self.grammar

    def fork(self) -> StructuredRequest:
        """An independent copy for a sibling sample (n > 1): same compiled spec, its own grammar state."""
        child = copy.copy(self)
        child.last_report = None
        if self.grammar is not None:
            child.grammar = self.grammar.clone()
        if self.finisher is not None:
            child.finisher = self.finisher.copy()
        if not self.share_hints:
            child.pick_hints = self.pick_hints.copy()
        return child

    def take_checked(self, token_id: int) -> bool:
        """Check a sampled pick against the grammar and, where allowed, take it at once (`checked_token`), so the
        pick's `advance` does not call the grammar again. Its first call in a step reads the grammar's state
        from memory (~6-10 µs after the model's forward has gone through the caches, against ~1 µs hot): one
        call, not a check then an accept, saves one of those a row; the forced tokens after it are found here
        too, while the state is in the caches. The caller guarantees the pick is appended or `untake_checked`
        is called before anything else reads the grammar (a mask fill)."""
        grammar = self.start()
        self.untake_checked()
        if not grammar.accept_tokens((token_id,)):
            return False
        self.checked_token = token_id
        self.checked_forced = grammar.find_jump_forward() if self._jump_forward else None
        return True

    def untake_checked(self) -> None:
        """Put back a pick taken by `take_checked` that will not be appended (its row is filled and drawn again)."""
        if self.checked_token is not None:
            self.checked_token, self.checked_forced = None, None
            assert self.grammar is not None
            self.grammar.rollback(1)

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
        taken = self.checked_token == token_id
        if not taken:
            self.untake_checked()  # (another token is appended: the check's is put back first)
        forced = self.checked_forced if taken else None
        self.checked_token, self.checked_forced = None, None
        if self.finisher is None:
            if not taken:
                self.accept([token_id])
            return Advance(True, self.jump_forward(known=forced) if jump_forward else [])
        grammar = self.start()
        step = self.finisher.advance(
            grammar, token_id, left=left, jump_forward=jump_forward, taken=taken, forced=forced
        )
        self.num_forced_tokens += len(step.tokens)
        return step

    @property
    def closed_at_budget(self) -> bool:
        return self.finisher is not None and self.finisher.closed_at_budget

    def withdraw_closing(self) -> None:
        """The closed output failed validation (a relaxed grammar): it is reported as cut, not closed."""
        if self.finisher is not None:
            self.finisher.closed_at_budget = False

    def jump_forward(self, *, known: list[int] | None = None) -> list[int]:
        """Forced tokens, already accepted by the grammar: append them to the sequence without sampling.
        `known`: the grammar's forced tokens, found already in this state (`take_checked`)."""
        grammar = self.start()
        forced = known if known is not None else grammar.find_jump_forward()
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
        self.checked_token, self.checked_forced = None, None
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
