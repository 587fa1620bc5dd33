"""After sampling: append each token, decide whether its sequence stops, and turn requests into outputs.

Stop rules, in vLLM's order: nothing but the length limits stops a sequence before `min_tokens`; then EOS (unless
`ignore_eos`), a `stop_token_ids` entry, a stop string in the detokenized text (the text is cut before it), then
`max_tokens` and the context limit ("length"). An EOS or stop token stays in `token_ids` but not in the text.

Text is produced incrementally (with stop strings held back until they cannot match) only when someone reads it
as it grows: a streaming request or one with stop strings. Otherwise the whole output is detokenized once,
when the sequence finishes, through the same detokenizer so both paths give the same text.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from structgen.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from structgen.engine.sequence import Request, Sequence, SequenceStatus
from structgen.tokenizer import IncrementalDetokenizer, StopChecker

if TYPE_CHECKING:
    from structgen.sampling_params import SamplingParams
    from structgen.tokenizer import Tokenizer


class SampledTokens(Protocol):
    """The part of the sampler's output read here (`structgen.engine.sampler.SamplerOutput`)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, *, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

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
            status = self._append_text(seq, token_id, incremental=request.stream or bool(_params(seq).stop))
            if status is not None:
                finished.append((seq, status))
        return finished

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

    def _append_text(self, seq: Sequence, token_id: int, *, incremental: bool) -> SequenceStatus | None:
        params = _params(seq)
        status, hide = self._token_stop(seq, token_id)
        if not incremental:
            if status is not None:
                ids = seq.output_token_ids[:-1] if hide else seq.output_token_ids
                seq.output_text = seq.detokenizer.push(ids) + seq.detokenizer.flush()
            return status
        delta = "" if hide else seq.detokenizer.push(token_id)
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

    def _token_stop(self, seq: Sequence, token_id: int) -> tuple[SequenceStatus | None, bool]:
        """(finish status or None, whether the token is left out of the text) for a just-appended token."""
        params = _params(seq)
        num_output = seq.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED, not params.include_stop_str_in_output
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
                )
            )
            seq.num_sent_chars = len(text)
            seq.num_sent_tokens = len(seq.output_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            metrics=request.metrics,
            num_cached_tokens=request.metrics.num_cached_tokens,
        )


def _params(seq: Sequence) -> SamplingParams:
    assert seq.params is not None, f"{seq} has no sampling params"
    return seq.params
