"""The reasoning phase of a sequence, by token id: where the answer starts, the reasoning budget, and the text of each.

With a reasoning parser on the engine (`structgen.tokenizer.reasoning`), a sequence's output is reasoning, then the
end marker, then the answer. `ReasoningState` follows one sequence through the phases (the parser says which it
starts in): while THINKING its grammar, if it has one, sits idle (the logits processor skips the row, nothing is
fed to the matcher) and the output is decoded into `text`, apart from the answer; the end marker, sampled or
forced, starts the answer, which `seq.output_text` holds alone, under the grammar from its first token (with the
grammar's forced prefix appended at once, as at the start of an output without reasoning).

The end marker is forced, without a forward, right after the token that reaches the request's
`thinking_token_budget`, or, for a request whose answer must come (a structured one), when the tokens left under
`max_tokens` come down to what the answer needs: its grammar's shortest complete output (`initial_need`) twice,
plus some room, so the budget closer can still finish it. A structured request may not end while thinking (EOS
and its stop tokens are banned there), and no answer may hold a marker token (banned after the switch), so
neither text ever carries one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from structgen.tokenizer.reasoning import ReasoningMarkers, ReasoningParser, ReasoningPhase

if TYPE_CHECKING:
    from structgen.sampling_params import SamplingParams
    from structgen.tokenizer import IncrementalDetokenizer

# Tokens the answer gets beyond twice its shortest completion before the end marker is forced by `max_tokens`.
_ANSWER_ROOM = 8


@dataclass(slots=True)
class ReasoningState:
    markers: ReasoningMarkers
    initial: ReasoningPhase
    budget: int | None  # reasoning tokens allowed (markers not counted); None: unlimited
    # Tokens the answer must find room for before `max_tokens` (0: none reserved; see the module docstring).
    answer_reserve: int
    # Banned while thinking (EOS and stop tokens of a request whose answer must come); empty otherwise.
    thinking_bans: tuple[int, ...] = ()
    phase: ReasoningPhase = field(init=False)
    num_tokens: int = 0  # reasoning tokens so far, markers left out
    answer_start: int | None = None  # index in the output tokens where the answer starts
    thought: bool = False  # the output has a reasoning phase (reported as `reasoning`, maybe "")
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # the reasoning's, while text is produced incrementally
    num_sent_chars: int = 0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Back to the start of the output (a structured retry samples it again)."""
        self.phase = self.initial
        self.num_tokens = 0
        self.thought = self.initial is ReasoningPhase.THINKING
        self.answer_start = 0 if self.initial is ReasoningPhase.ANSWER else None
        self.text = ""
        self.detokenizer = None
        self.num_sent_chars = 0

    def copy(self) -> ReasoningState:
        twin = ReasoningState(
            self.markers, self.initial, self.budget, self.answer_reserve, thinking_bans=self.thinking_bans
        )
        twin.phase, twin.num_tokens, twin.answer_start = self.phase, self.num_tokens, self.answer_start
        twin.thought, twin.text, twin.num_sent_chars = self.thought, self.text, self.num_sent_chars
        # A fork is taken before its first sampled token, when nothing is held in a detokenizer: it makes its own.
        return twin

    @property
    def thinking(self) -> bool:
        return self.phase is ReasoningPhase.THINKING

    @property
    def pending(self) -> bool:
        return self.phase is ReasoningPhase.PENDING

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the sequence may not produce at its next step."""
        if self.phase is ReasoningPhase.THINKING:
            return self.thinking_bans
        if self.phase is ReasoningPhase.PENDING:
            return (self.markers.end_token_id,)
        return (self.markers.start_token_id, self.markers.end_token_id)

    @property
    def opening_token_id(self) -> int | None:
        """A token the sequence may take besides its grammar's: the start marker, while the first token decides."""
        return self.markers.start_token_id if self.phase is ReasoningPhase.PENDING else None

    def must_end(self, left: int) -> bool:
        """Whether to force the end marker now, `left` tokens still allowed after the last one."""
        return (self.budget is not None and self.num_tokens >= self.budget) or left <= self.answer_reserve

    def num_reasoning_tokens(self, num_output_tokens: int) -> int:
        """Output tokens spent before the answer, markers included."""
        return self.answer_start if self.answer_start is not None else num_output_tokens


def answer_reserve(need: int | None, *, structured: bool) -> int:
    """The tokens to keep for the answer when `max_tokens` runs low (see the module docstring): room for the end
    marker, and for a structured answer twice its shortest completion and some; an unconstrained answer has no
    length it needs, so nothing is kept for it."""
    if not structured:
        return 0
    return 1 + (2 * need + _ANSWER_ROOM if need is not None else _ANSWER_ROOM)


def new_state(
    parser: ReasoningParser,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    default_budget: int | None,
    eos_token_ids: frozenset[int],
) -> ReasoningState:
    """A request's reasoning state at the start of its output. A structured request's reserve for its answer is
    refined once its grammar is compiled (`StructuredOutputs.poll`)."""
    structured = params.structured_outputs is not None
    budget = params.thinking_token_budget if params.thinking_token_budget is not None else default_budget
    # An answer under a grammar must come: the model may not end (or stop) while it reasons.
    bans = tuple(sorted(eos_token_ids | set(params.stop_token_ids or ()))) if structured else ()
    return ReasoningState(
        parser.markers,
        parser.initial_phase(prompt_token_ids),
        budget,
        answer_reserve(None, structured=structured),
        thinking_bans=bans,
    )


def ban_phase_tokens(logits: torch.Tensor, seqs: Sequence[Any]) -> None:
    """-inf, in place, for the tokens each row's reasoning phase rules out (`ReasoningState.banned_token_ids`):
    markers in an answer, the end of a structured request before its answer. Raw logits are finite, so a ban of
    a few ids never leaves a row without a token. (Logprobs are read after it, as after the grammar's mask.)"""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        if seq.reasoning is not None:
            for token in seq.reasoning.banned_token_ids:
                if 0 <= token < vocab:
                    rows.append(row)
                    cols.append(token)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
