"""The output processor's steps for a sequence still before its answer (`reasoning.ReasoningState`): the first
token of a PENDING output, each reasoning token, and the switch to the answer (the end marker sampled, or forced
by the budget), after which `OutputProcessor` handles the sequence as any other."""

from __future__ import annotations

from typing import TYPE_CHECKING

from structgen.engine.outputs import TokenLogprob
from structgen.tokenizer import IncrementalDetokenizer
from structgen.tokenizer.reasoning import ReasoningPhase

if TYPE_CHECKING:
    from structgen.engine.output_processor import OutputProcessor
    from structgen.engine.sequence import Sequence, SequenceStatus


def advance(
    proc: OutputProcessor, seq: Sequence, token_id: int, *, incremental: bool
) -> SequenceStatus | None:
    """`token_id` was just appended to `seq`, which is PENDING or THINKING."""
    state = seq.reasoning
    markers = state.markers
    if state.pending:
        if token_id != markers.start_token_id:  # the model answers without reasoning
            state.phase = ReasoningPhase.ANSWER
            state.answer_start = seq.num_output_tokens - 1
            return proc.advance_answer(seq, token_id, incremental=incremental)
        state.phase, state.thought = ReasoningPhase.THINKING, True
        status, _ = proc.token_stop(seq, token_id, grammar_may_end=False)
        return (
            _stop_thinking(proc, seq, status, incremental) if status else end_if_due(proc, seq, incremental)
        )
    if token_id == markers.end_token_id:
        return _start_answer(proc, seq, incremental)
    status, hide = proc.token_stop(seq, token_id, grammar_may_end=False)
    if not hide and token_id != markers.start_token_id:
        state.num_tokens += 1
        if incremental:
            state.text += _detokenizer(proc, seq).push(token_id)
    if status is not None:
        return _stop_thinking(proc, seq, status, incremental, hide=hide)
    return end_if_due(proc, seq, incremental)


def end_if_due(proc: OutputProcessor, seq: Sequence, incremental: bool) -> SequenceStatus | None:
    """Force the end marker when the budget is spent or the answer needs the tokens left (no forward: its KV is
    computed with the next token's, like any forced token)."""
    state = seq.reasoning
    if not state.must_end(proc.tokens_left(seq)):
        return None
    end = state.markers.end_token_id
    seq.append_token(end)
    if seq.logprobs is not None:  # forced: probability 1
        seq.logprobs.append(TokenLogprob(end, 0.0, []))
    proc.num_forced_tokens += 1
    return _start_answer(proc, seq, incremental)


def _start_answer(proc: OutputProcessor, seq: Sequence, incremental: bool) -> SequenceStatus | None:
    """The end marker is the last token: the answer starts after it, decoded on its own, under the grammar."""
    state = seq.reasoning
    state.phase = ReasoningPhase.ANSWER
    state.answer_start = seq.num_output_tokens
    _finish_text(proc, seq, incremental, hide=False)
    seq.detokenizer = IncrementalDetokenizer(
        proc.tokenizer, seq.token_ids, skip_special_tokens=seq.params.skip_special_tokens
    )
    status, _ = proc.token_stop(seq, state.markers.end_token_id, grammar_may_end=False)
    if status is not None:  # `max_tokens` or the context ends it on the marker: an empty answer
        return status
    return proc.begin_answer(seq, incremental=incremental)


def _stop_thinking(
    proc: OutputProcessor, seq: Sequence, status: SequenceStatus, incremental: bool, *, hide: bool = False
) -> SequenceStatus:
    """The sequence ends before its answer (EOS, a stop token, `max_tokens`): the reasoning is all there is."""
    _finish_text(proc, seq, incremental, hide=hide)
    return status


def _finish_text(proc: OutputProcessor, seq: Sequence, incremental: bool, *, hide: bool) -> None:
    state = seq.reasoning
    if incremental:
        if state.detokenizer is not None:
            state.text += state.detokenizer.flush()
        state.detokenizer = None
        return
    # Decoded once, through a detokenizer like the incremental path, so both give the same text.
    end = state.answer_start - 1 if state.answer_start is not None else seq.num_output_tokens - int(hide)
    start_id = state.markers.start_token_id
    ids = [t for t in seq.output_token_ids[:end] if t != start_id]
    detokenizer = IncrementalDetokenizer(
        proc.tokenizer, seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
    )
    state.text = detokenizer.push(ids) + detokenizer.flush()


def _detokenizer(proc: OutputProcessor, seq: Sequence) -> IncrementalDetokenizer:
    state = seq.reasoning
    if state.detokenizer is None:
        # Context: the tokens before this one (the prompt, or a fork's tokens so far).
        state.detokenizer = IncrementalDetokenizer(
            proc.tokenizer, seq.token_ids[:-1], skip_special_tokens=seq.params.skip_special_tokens
        )
    return state.detokenizer
