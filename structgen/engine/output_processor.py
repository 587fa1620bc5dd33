"""After sampling: append each token, decide whether its sequence stops, and turn requests into outputs.

Stop rules, in vLLM's order: nothing but the length limits stops a sequence before `min_tokens`; then EOS (unless
`ignore_eos`), a `stop_token_ids` entry, a stop string in the detokenized text (the text is cut before it), then
`max_tokens` and the context limit ("length"). An EOS or stop token stays in `token_ids` but not in the text.

Text is produced incrementally (with stop strings held back until they cannot match) only when someone reads it
as it grows: a streaming request or one with stop strings. Otherwise the whole output is detokenized once,
when the sequence finishes, through the same detokenizer so both paths give the same text.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from structgen.engine import reasoning_output
from structgen.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from structgen.engine.sequence import Request, Sequence, SequenceStatus
from structgen.engine.structured_report import structured_report
from structgen.structured.errors import StructuredOutputError
from structgen.tokenizer import IncrementalDetokenizer, StopChecker
from structgen.tokenizer.reasoning import ReasoningPhase

if TYPE_CHECKING:
    from structgen.sampling_params import SamplingParams
    from structgen.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class SampledTokens(Protocol):
    """The part of the sampler's output read here (`structgen.engine.sampler.SamplerOutput`)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        jump_forward: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.jump_forward = jump_forward
        self.num_forced_tokens = 0  # appended by jump-forward, never sampled
        self.num_grammar_errors = 0

    def process(
        self, seqs: list[Sequence], sampled: SampledTokens, requests: dict[str, Request]
    ) -> list[tuple[Sequence, SequenceStatus]]:
        """Append `sampled.token_ids[i]` to `seqs[i]`; returns the sequences that finished, with their status."""
        now = time.monotonic()
        finished = []
        for i, (seq, token_id) in enumerate(zip(seqs, sampled.token_ids, strict=True)):
            request = requests[seq.request_id]
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_output_tokens += 1
            seq.append_token(token_id)
            metrics.max_sample_tokens = max(metrics.max_sample_tokens, seq.num_output_tokens)
            if seq.logprobs is not None and sampled.logprobs is not None:
                logprob = sampled.logprobs[i]
                top = sampled.top_logprobs[i] if sampled.top_logprobs is not None else []
                seq.logprobs.append(TokenLogprob(token_id, logprob, top))
                seq.cumulative_logprob += logprob
            incremental = request.stream or bool(_params(seq).stop)
            try:
                if seq.reasoning is not None and seq.reasoning.phase is not ReasoningPhase.ANSWER:
                    status = reasoning_output.advance(self, seq, token_id, incremental=incremental)
                else:
                    status = self.advance_answer(seq, token_id, incremental=incremental)
            except Exception as error:
                # A bug in a grammar library or the detokenizer: fail this request, keep the batch going.
                status = self.fail(seq, error)
            if status is not None:
                finished.append((seq, status))
        return finished

    def advance_answer(self, seq: Sequence, token_id: int, *, incremental: bool) -> SequenceStatus | None:
        """A token of the output proper (of the answer, after any reasoning)."""
        if seq.structured is not None:
            return self._advance_grammar(seq, token_id, incremental=incremental)
        return self._append_text(seq, token_id, incremental=incremental)

    def begin(self, seq: Sequence, *, incremental: bool) -> SequenceStatus | None:
        """Before the first forward (and again on a retry): what the output starts with. The grammar's forced
        prefix; or, for an output that starts with reasoning, the end marker already when its budget is 0."""
        state = seq.reasoning
        if state is None or state.phase is ReasoningPhase.ANSWER:
            return self.begin_answer(seq, incremental=incremental)
        if state.thinking:
            return reasoning_output.end_if_due(self, seq, incremental)
        return None  # PENDING: the first token decides, under the grammar or opening the reasoning

    def begin_answer(self, seq: Sequence, *, incremental: bool) -> SequenceStatus | None:
        """The answer starts: append the tokens its grammar forces first (already accepted by it)."""
        if seq.structured is None or not self.jump_forward:
            return None
        return self.append_forced(seq, seq.structured.jump_forward(), incremental=incremental)

    def _advance_grammar(self, seq: Sequence, token_id: int, *, incremental: bool) -> SequenceStatus | None:
        """Feed the sampled token to the sequence's grammar, then append what follows it: the tokens the grammar
        forces, the end of a value the model loops in, or, at the budget, the closing completion in its place."""
        structured = seq.structured
        try:
            # EOS ends the sequence (the mask allowed it only where the grammar can end): not fed to it.
            if token_id in self.eos_token_ids:
                structured.untake_checked()  # (the sampler's check takes no EOS it knows; this one it did not)
                return self._append_text(seq, token_id, incremental=incremental)
            step = structured.advance(token_id, left=self.tokens_left(seq), jump_forward=self.jump_forward)
        except StructuredOutputError as error:
            # The mask allowed a token the matcher refuses: a bug in a backend. Fail this request loudly.
            logger.error("%s: %s", seq, error)
            self.num_grammar_errors += 1
            seq.error = str(error)
            return SequenceStatus.FINISHED_ERROR
        if step.kept:
            # The grammar may end only after what follows the token, if anything does.
            status = self._append_text(
                seq, token_id, incremental=incremental, grammar_may_end=not step.tokens
            )
            if status is not None:
                return status
        else:
            _drop_last_token(seq)
        status = self.append_forced(seq, step.tokens, incremental=incremental)
        if status is None and step.end:
            # Complete, but its last token did not stop it (the budget ran out on a complete text, or the
            # grammar would allow more, as after a number): stop here.
            status = self._append_text(seq, None, incremental=incremental)
        return status

    def tokens_left(self, seq: Sequence) -> int:
        """How many more tokens `seq` may take (after the ones it holds): `max_tokens` and the context."""
        left = self.max_model_len - len(seq.token_ids)
        if seq.max_tokens is not None:
            left = min(left, seq.max_tokens - seq.num_output_tokens)
        return left

    def fail(self, seq: Sequence, error: Exception) -> SequenceStatus:
        """End `seq` because its grammar or detokenization raised (the error is logged and reported)."""
        logger.error("%s failed: %r", seq, error, exc_info=error)
        if seq.structured is not None:
            self.num_grammar_errors += 1
        seq.error = f"internal error while producing this output ({type(error).__name__}: {error})"
        return SequenceStatus.FINISHED_ERROR

    def append_forced(self, seq: Sequence, forced: list[int], *, incremental: bool) -> SequenceStatus | None:
        """Append tokens the grammar forces (already accepted by it), with their text and stop checks."""
        for i, forced_id in enumerate(forced):
            seq.append_token(forced_id)
            if seq.logprobs is not None:  # forced: probability 1 under the grammar
                seq.logprobs.append(TokenLogprob(forced_id, 0.0, []))
            self.num_forced_tokens += 1
            # The grammar accepted all of `forced` already: it may only end after the last one.
            last = i == len(forced) - 1
            status = self._append_text(seq, forced_id, incremental=incremental, grammar_may_end=last)
            if status is not None:
                return status
        return None

    def finish_structured(self, seq: Sequence, status: SequenceStatus) -> SequenceStatus | None:
        """Validate a finished structured output. Returns the final status, or None when the sequence should
        sample again (a relaxed grammar's output failed validation and retries remain)."""
        structured = seq.structured
        if status is not SequenceStatus.FINISHED_STOPPED:
            return status  # "length" (incomplete, not valid), "error", "abort": nothing to validate
        result = structured.validate(seq.output_text)
        if not result.valid and structured.closed_at_budget:
            # A relaxed grammar's shortest completion missed the schema: no valid output fit the budget. It counts
            # as cut short, as without closing (a resample would meet the same budget).
            structured.withdraw_closing()
            return SequenceStatus.FINISHED_LENGTH
        if structured.should_retry():
            return None
        if not result.valid and structured.failed_strict():
            seq.error = f"the output does not satisfy the requested {structured.spec.kind}: {result.error}"
            return SequenceStatus.FINISHED_ERROR
        return status

    def start_fork(self, child: Sequence, *, incremental: bool) -> None:
        """`start` for a fork that already carries output tokens (a grammar's forced prefix, or a forced end of
        reasoning and then that)."""
        self.start(child)
        state = child.reasoning
        if state is not None and state.answer_start:
            context = child.token_ids[: child.num_prompt_tokens + state.answer_start]
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer, context, skip_special_tokens=_params(child).skip_special_tokens
            )
        answer = _answer_ids(child)
        if incremental and answer:
            child.output_text = child.detokenizer.push(answer)

    def restart(self, seq: Sequence) -> None:
        """Forget a sequence's output (a structured retry); its grammar was reset by the caller."""
        del seq.token_ids[seq.num_prompt_tokens :]
        seq.output_token_ids.clear()
        seq.output_text = ""
        seq.num_sent_chars = seq.num_sent_tokens = 0
        seq.cumulative_logprob = 0.0
        seq.stop_reason = None
        if seq.reasoning is not None:
            seq.reasoning.reset()
        self.start(seq)

    def start(self, seq: Sequence) -> None:
        """Set up a sequence's output state before its first token (also for forks)."""
        params = _params(seq)
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        seq.stop_checker = (
            StopChecker(params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            if params.stop
            else None
        )
        seq.logprobs = [] if params.logprobs is not None else None

    def _append_text(
        self, seq: Sequence, token_id: int | None, *, incremental: bool, grammar_may_end: bool = True
    ) -> SequenceStatus | None:
        """The text of a just-appended token and whether the sequence stops there; `token_id` None: no new
        token, the sequence stops now (a structured output closed complete)."""
        params = _params(seq)
        if token_id is None:
            status, hide = SequenceStatus.FINISHED_STOPPED, False
        else:
            status, hide = self.token_stop(seq, token_id, grammar_may_end=grammar_may_end)
        if not incremental:
            if status is not None:
                ids = _answer_ids(seq)
                ids = ids[:-1] if hide else ids
                seq.output_text = seq.detokenizer.push(ids) + seq.detokenizer.flush()
            return status
        delta = "" if hide or token_id is None else seq.detokenizer.push(token_id)
        if status is not None:
            delta += seq.detokenizer.flush()
        checker = seq.stop_checker
        # Before `min_tokens` a stop string does not count, so that text bypasses the checker.
        if checker is not None and seq.num_output_tokens > params.min_tokens:
            delta, matched = checker.push(delta)
            if matched is not None:
                status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = matched
            elif status is not None:
                delta += checker.flush()
        seq.output_text += delta
        return status

    def token_stop(
        self, seq: Sequence, token_id: int, *, grammar_may_end: bool = True
    ) -> tuple[SequenceStatus | None, bool]:
        """(finish status or None, whether the token is left out of the text) for a just-appended token."""
        params = _params(seq)
        num_output = seq.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED, not params.include_stop_str_in_output
        if grammar_may_end and seq.structured is not None and seq.structured.is_terminated():
            return SequenceStatus.FINISHED_STOPPED, False  # the grammar is complete: nothing may follow
        if seq.max_tokens is not None and num_output >= seq.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, False
        if len(seq.token_ids) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, False
        return None, False

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now; marks everything in it as sent (the next deltas start after it)."""
        outputs = []
        for seq in request.seqs:
            text = seq.output_text
            if seq.structured is not None and seq.structured.holds_back_output and not seq.is_finished:
                # Validated at the end and maybe resampled: the whole text goes out as one final delta.
                outputs.append(_held(seq))
                continue
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    delta_text=text[seq.num_sent_chars :],
                    delta_token_ids=seq.output_token_ids[seq.num_sent_tokens :],
                    error=seq.error,
                    error_code=seq.error_code,
                    structured=structured_report(seq) if seq.structured is not None else None,
                )
            )
            seq.num_sent_chars = len(text)
            seq.num_sent_tokens = len(seq.output_token_ids)
            if seq.reasoning is not None:
                _add_reasoning(outputs[-1], seq)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            metrics=request.metrics,
            num_cached_tokens=request.metrics.num_cached_tokens,
            prompt_logprobs=_prompt_logprobs(request.seqs[0]),
        )


def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
    """The first sample's prompt logprobs once every prompt token is scored (its forks share its prompt). The list
    itself, not a copy: complete, it never changes again, and a stream would otherwise copy it every step."""
    scores = seq.prompt_logprobs
    return scores if scores is not None and not seq.scores_prompt else None


def _answer_ids(seq: Sequence) -> list[int]:
    """The output tokens of the answer: all of them, or those after the reasoning's end marker."""
    state = seq.reasoning
    if state is None or state.answer_start == 0:
        return seq.output_token_ids
    return seq.output_token_ids[state.answer_start :] if state.answer_start is not None else []


def _add_reasoning(output: CompletionOutput, seq: Sequence) -> None:
    state = seq.reasoning
    output.num_reasoning_tokens = state.num_reasoning_tokens(seq.num_output_tokens)
    if state.thought:
        output.reasoning = state.text
        output.delta_reasoning = state.text[state.num_sent_chars :]
        state.num_sent_chars = len(state.text)


def _drop_last_token(seq: Sequence) -> None:
    """Take back the token just sampled (the closing completion goes in its place)."""
    seq.token_ids.pop()
    seq.output_token_ids.pop()
    if seq.logprobs:
        seq.cumulative_logprob -= seq.logprobs.pop().logprob


def _held(seq: Sequence) -> CompletionOutput:
    """What a client has seen of a held-back sequence so far (nothing new)."""
    return CompletionOutput(
        index=seq.index,
        text=seq.output_text[: seq.num_sent_chars],
        token_ids=list(seq.output_token_ids[: seq.num_sent_tokens]),
    )


def _params(seq: Sequence) -> SamplingParams:
    assert seq.params is not None, f"{seq} has no sampling params"
    return seq.params
