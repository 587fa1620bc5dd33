"""The batch logits processor the engine installs for structured output: `logits_processor(logits, seqs)`.

It fills the bitmask rows of the constrained sequences (started early with `prepare`, so the fill overlaps the
model forward) and masks only those rows, or, deferring to the sampler, hands over a `TokenMask` in which rows
of grammars that check single tokens cheaply are left unfilled until the sampler needs them whole.

Before the lm_head, `narrow_rows` tells the runner which rows' masks, filled during the forward, allow only a
few tokens: their logits are computed for those tokens alone (`structgen.engine.narrow_logits`) and the sampler
picks among them. Which lazy rows to fill ahead for that is each request's guess by kind of position
(`pick_hints`). Those rows are filled first, as one job on the mask thread, and `narrow_rows` waits for that job
alone; the other rows filled ahead (hinted rows expected wide, rows that need the whole masked distribution)
are a second job, which overlaps the lm_head too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from structgen.engine.fast_picks import list_allowed_rows
from structgen.engine.token_mask import TokenMask, needs_masked_distribution
from structgen.structured.backend import Grammar
from structgen.structured.bitmask import apply_token_bitmask_
from structgen.structured.manager import FillFailures, StructuredOutputManager

T = TypeVar("T")


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
        overlap: bool = True,
    ):
        self.manager = manager
        # Fill on the mask thread while the forward runs; False: fill in `prepare` itself, on the caller's thread.
        # Overlapping needs a core the forward leaves free: on a CPU whose every core runs the forward's threads,
        # the mask thread only takes turns with them (and hands the GIL back and forth with the step thread), and
        # filling in place measured ~2% faster a step on `tiny`, the same on SmolLM2 (BENCHMARKS.md, session 22).
        self.overlap = overlap
        self.grammar_of = grammar_of
        # A token a row may take besides its grammar's, or None (a reasoning model's opening marker, before its
        # first token decides between reasoning and answering under the grammar).
        self.also_allowed = also_allowed
        self._extra: dict[int, int] = {}  # this step's rows with such a token
        # Hand the mask to the sampler (a `TokenMask`) instead of applying it: the sampler masks only the
        # rows whose pick the mask would change.
        self.defer = defer
        self._bitmask = manager.allocate_bitmask(64)
        self._pending: _Fill | None = None
        # Sequences whose grammar raised while filling the last mask; the engine fails them (`take_failures`).
        self._failures: list[tuple[Any, Exception]] = []
        # The last step's sequences, deferred mask and each constrained row's position (see `pick_hints`).
        self._last: tuple[list[Any], TokenMask, dict[int, int | None]] | None = None
        self._positions: dict[int, int | None] = {}  # this step's, by row
        self._hinted: set[int] = set()  # ids of this step's sequences to mask first (see TokenMask)
        # Where the runner computes the logits of narrow rows for their allowed tokens alone (the engine sets
        # it: CPU, one rank): rows whose mask allows at most this many tokens; 0 leaves every row whole.
        self.narrow_limit = 0
        self._narrowed: dict[int, torch.Tensor] = {}  # this step's rows computed narrow: their allowed ids
        self._eos = frozenset(manager.tokenizer.eos_token_ids)

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
                position = self._positions[row] = request.hint_context
                if request.pick_hints.hinted(position):
                    self._hinted.add(id(seqs[row]))
        self._extra = {}
        if self.also_allowed is not None:
            for _, row in items:
                token = self.also_allowed(seqs[row])
                if token is not None:
                    self._extra[row] = token
        narrow_first, ahead, deferred = self._split_deferred(seqs, items)
        self._pending = _Fill(
            seqs=list(seqs),
            items=items,
            deferred=deferred,
            first=self._start(self._fill_and_list, narrow_first, self._bitmask, self.narrow_limit)
            if narrow_first
            else _done(([], {})),
            rest=self._start(self.manager.fill_bitmask, ahead, self._bitmask) if ahead else _done([]),
        )

    def _start(self, job: Callable[..., T], *args: Any) -> Future[T]:
        """`job(*args)` on the mask thread (`overlap`), else run now; either way a future of its outcome (an
        error is raised where the result is read, as from the mask thread)."""
        if self.overlap:
            return self.manager.on_mask_thread(job, *args)
        future: Future[T] = Future()
        try:
            future.set_result(job(*args))
        except Exception as error:
            future.set_exception(error)
        return future

    def __call__(self, logits: torch.Tensor, seqs: Sequence[Any]) -> TokenMask | None:
        pending = self._pending
        if pending is None or not _same_seqs(pending.seqs, seqs):
            self.prepare(seqs)
            pending = self._pending
        assert pending is not None
        self._pending = None
        seqs_, items, deferred = pending.seqs, pending.items, pending.deferred
        narrowed, self._narrowed = self._narrowed, {}
        rows = [row for _, row in items]
        failures = pending.first.result()[0] + pending.rest.result()
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
                eager=[r for r in rows if id(seqs[r]) in self._hinted or r in narrowed],
                allowed=narrowed,
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

    def narrow_rows(self, seqs: Sequence[Any], vocab: int) -> dict[int, torch.Tensor]:
        """{row: allowed token ids, ascending} of this step's rows whose mask, filled ahead, allows at most
        `narrow_limit` tokens (of the first `vocab`): the runner computes their logits for those tokens alone,
        and the sampler picks among them. Only rows expected narrow are candidates; waits for their fill and
        listing on the mask thread (started by `prepare`, so normally done by the end of the forward). Each
        tells its request whether its position was narrow. Rows that need the whole distribution (logprobs,
        top-k/p), that may also take a token besides their grammar's, or whose fill failed, stay whole."""
        pending = self._pending
        self._narrowed = {}
        if not self.narrow_limit or pending is None or not _same_seqs(pending.seqs, seqs):
            return {}
        _, listed = pending.first.result()  # the rows filled first (those expected narrow), listed
        narrow: dict[int, torch.Tensor] = {}
        for row, ids in listed.items():
            if ids is not None and len(ids) > 0 and int(ids[-1]) >= vocab:
                ids = ids[ids < vocab]  # listed up to the bitmask's width; the model's vocabulary may be less
            request = getattr(pending.seqs[row], "structured", None)
            if request is not None:
                request.pick_hints.saw_width(self._positions.get(row), narrow=ids is not None)
            if ids is not None and len(ids) > 0:  # none allowed: the sampler reports the row as dead
                narrow[row] = ids
        self._narrowed = narrow
        return narrow

    def _split_deferred(
        self, seqs: Sequence[Any], items: list[tuple[Grammar, int]]
    ) -> tuple[list[tuple[Grammar, int]], list[tuple[Grammar, int]], list[int]]:
        """(rows to fill first, on the mask thread, for their narrow logits; other rows to fill then; rows left
        unfilled). A deferred row's pick is checked against its grammar alone (a few µs where filling the row
        walks the vocabulary) and the row is filled only if the sampler needs it whole: rows of grammars that
        check tokens cheaply, picked lazily, not hinted. A row that may be narrowed (picked lazily, no token
        besides its grammar's) and whose request expects its position narrow is filled first; one expected wide
        is not measured, and its expectation fades towards another try (`PickHints.left_unfilled`)."""
        if not self.defer:
            return [], items, []
        narrow_first, ahead, deferred = [], [], []
        tried: set[tuple[int, int | None]] = set()  # (hints, position) in doubt with a row filled this step
        for grammar, row in items:
            seq = seqs[row]
            params = getattr(seq, "params", None)
            lazy = params is not None and not needs_masked_distribution(params)
            request = getattr(seq, "structured", None)
            if self.narrow_limit and lazy and request is not None and row not in self._extra:
                hints, position = request.pick_hints, self._positions.get(row)
                if hints.expects_narrow(position):
                    doubt = (id(hints), position)
                    if hints.sure_narrow(position) or doubt not in tried:
                        tried.add(doubt)
                        narrow_first.append((grammar, row))  # for its narrow logits (`narrow_rows`)
                        continue
                else:
                    hints.left_unfilled(position)
            if grammar.checks_tokens_cheaply and lazy and id(seq) not in self._hinted:
                deferred.append(row)
            else:
                ahead.append((grammar, row))
        return narrow_first, ahead, deferred

    def _fill_and_list(
        self, items: list[tuple[Grammar, int]], bitmask: torch.Tensor, limit: int
    ) -> tuple[FillFailures, dict[int, torch.Tensor | None]]:
        """On the mask thread: fill the rows expected narrow, then list the ids each allows (None: more than
        `limit`), so that `narrow_rows`, on the forward's path, only reads them."""
        failures = self.manager.fill_bitmask(items, bitmask)
        failed = {row for row, _ in failures}
        rows = [row for _, row in items if row not in failed]
        listed = list_allowed_rows(bitmask, rows, bitmask.shape[1] * 32, limit=limit)
        return failures, dict(zip(rows, listed, strict=True))

    def _token_check(self, seq: Any, grammar: Grammar, extra: int | None = None) -> Callable[[int], bool]:
        """A deferred row's check of one pick. An allowed pick other than EOS (which the grammar is never fed) is
        taken by the grammar at once (`StructuredRequest.take_checked`): one call to the grammar where a check
        and then an accept took two, each reading its state from memory the forward has just evicted."""
        validate = grammar.validate_tokens
        request = getattr(seq, "structured", None)
        take = (
            getattr(request, "take_checked", None) if getattr(request, "grammar", None) is grammar else None
        )
        eos = self._eos

        def check(token: int) -> bool:
            if token == extra:
                return True
            try:
                if take is not None and token not in eos:
                    return take(token)
                return validate((token,)) == 1
            except Exception as error:  # a grammar bug: its request fails after this step, the batch goes on
                self._failures.append((seq, error))
                return True

        return check

    def _fill_now(self, seqs: list[Any], grammars: dict[int, Grammar], rows: list[int]) -> None:
        """Fill deferred rows the sampler needs whole. A row whose grammar raises allows everything for this
        step; its request fails after the step, like a failed fill ahead. A row whose check took a pick puts it
        back first (the sampler is drawing the row again: its batch is retried without a dead row)."""
        for row in rows:
            untake = getattr(getattr(seqs[row], "structured", None), "untake_checked", None)
            if untake is not None:
                untake()
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
            self._pending.first.result()
            self._pending.rest.result()
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


@dataclass(slots=True)
class _Fill:
    """One step's mask fill on the mask thread: the rows expected narrow first (`first`, which `narrow_rows`
    waits for), then the other rows filled ahead (`rest`); `deferred` rows are left unfilled."""

    seqs: list[Any]
    items: list[tuple[Grammar, int]]
    deferred: list[int]
    first: Future[tuple[FillFailures, dict[int, torch.Tensor | None]]]  # and the ids each row allows
    rest: Future[FillFailures]


def _same_seqs(prepared: list[Any], seqs: Sequence[Any]) -> bool:
    return len(prepared) == len(seqs) and all(a is b for a, b in zip(prepared, seqs, strict=True))


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


def _done(result: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(result)
    return future
