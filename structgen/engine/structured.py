"""The engine's side of structured output: one `StructuredOutputManager` per engine, built on the first
structured request, and the life of each constrained sequence around the step loop.

A constrained request waits in WAITING_FOR_GRAMMAR while its grammar compiles on the manager's thread pool
(other requests keep decoding). Before each schedule `poll` starts the grammars whose compile finished: a
failed compile ends that request with finish reason "error"; a successful one appends the tokens the grammar
forces at the start (e.g. `{"`), which are then prefilled with the prompt. Before the forward `prepare` starts
filling, on the mask thread, the bitmask rows the sampler will need whole; the installed
`StructuredLogitsProcessor` hands the mask to the sampler (a `TokenMask`, applied only to rows whose pick it
would change; rows left unfilled are checked token by token and filled only if a pick is rejected).
With a reasoning parser, a sequence still reasoning has no row in the mask (its grammar starts, forced prefix
and all, after the end marker: `structgen.engine.reasoning`), and one whose first token decides between
reasoning and answering may also take the start marker.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from structgen.engine.reasoning import answer_reserve
from structgen.engine.sampler import make_generator
from structgen.engine.sequence import Request, Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

    from structgen.engine.output_processor import OutputProcessor
    from structgen.engine.scheduler import Scheduler
    from structgen.structured import (
        StructuredLogitsProcessor,
        StructuredOutputConfig,
        StructuredOutputManager,
        StructuredOutputsParams,
    )
    from structgen.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Retry `r` of a seeded request samples from `seed + r * _RETRY_SEED_STRIDE` (clear of the `seed + i` of forks).
_RETRY_SEED_STRIDE = 1_000_003


class StructuredOutputs:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        config: StructuredOutputConfig | None,
        device: torch.device,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self.device = device
        self.manager: StructuredOutputManager | None = None
        self.processor: StructuredLogitsProcessor | None = None
        self._compiling: list[Sequence] = []
        self.num_retries = 0

    @property
    def jump_forward(self) -> bool:
        return self.config is None or self.config.jump_forward

    def ensure_manager(self) -> StructuredOutputManager:
        """The engine's manager, built on first use (reading the vocabulary takes a moment, once)."""
        if self.manager is None:
            from structgen.structured import (
                StructuredLogitsProcessor,
                StructuredOutputConfig,
                StructuredOutputManager,
                TokenizerInfo,
            )

            info = TokenizerInfo.from_tokenizer(self.tokenizer, vocab_size=self.vocab_size)
            self.manager = StructuredOutputManager(info, self.config or StructuredOutputConfig())
            self.processor = StructuredLogitsProcessor(
                self.manager,
                _grammar_of,
                defer=True,
                also_allowed=_opening_token,
                overlap=overlap_fills(self.device),
            )
        return self.manager

    def attach(self, seq: Sequence, params: StructuredOutputsParams) -> None:
        """Give `seq` its grammar request; the compile starts now. Raises the compile error at once when it
        is already known (a cached failure), so the caller can reject the request synchronously."""
        from structgen.structured import StructuredRequest

        sampling = getattr(seq, "params", None)
        seeded = sampling is not None and sampling.seed is not None
        request = StructuredRequest(self.ensure_manager(), params, share_hints=not seeded)
        future = request.future
        if future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
        seq.structured = request
        seq.ready = lambda: request.grammar is not None
        seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
        self._compiling.append(seq)

    def poll(
        self, scheduler: Scheduler, output_processor: OutputProcessor, requests: dict[str, Request]
    ) -> list[tuple[Sequence, SequenceStatus]]:
        """Start the grammars whose compile finished. Returns the sequences that ended before running: a
        failed compile (FINISHED_ERROR, `seq.error` set) or a grammar whose forced prefix is the whole output."""
        if not self._compiling:
            return []
        ended: list[tuple[Sequence, SequenceStatus]] = []
        still = []
        for seq in self._compiling:
            request = seq.structured
            if seq.is_finished or request is None:
                continue  # aborted while compiling
            if not request.ready():
                still.append(seq)
                continue
            try:
                request.start()
            except Exception as error:  # the compile's error: unsupported schema, time limit, bad grammar
                from structgen.structured import CompileTimeoutError

                seq.error = str(error)
                seq.error_code = (
                    "compile_timeout" if isinstance(error, CompileTimeoutError) else "unsupported_schema"
                )
                ended.append((seq, SequenceStatus.FINISHED_ERROR))
                continue
            if seq.reasoning is not None:
                seq.reasoning.answer_reserve = answer_reserve(request.initial_need, structured=True)
            try:
                status = output_processor.begin(seq, incremental=_incremental(seq, requests))
            except Exception as error:  # a grammar or detokenizer bug: this request alone fails
                status = output_processor.fail(seq, error)
            if status is not None:
                ended.append((seq, status))
        self._compiling = still
        return ended

    def take_failures(self, sample_seqs: list[Sequence]) -> dict[int, str]:
        """{index in `sample_seqs`: error} for the sequences whose grammar raised while filling this step's
        mask (their sampled token is meaningless: the engine fails them)."""
        if self.processor is None:
            return {}
        index = {id(seq): i for i, seq in enumerate(sample_seqs)}
        failed = {}
        for seq, error in self.processor.take_failures():
            logger.error("%s: filling its token mask failed: %r", seq, error, exc_info=error)
            if id(seq) in index:
                failed[index[id(seq)]] = f"internal error in its grammar ({type(error).__name__}: {error})"
        return failed

    def wait(self, timeout: float) -> None:
        """Block until some grammar being compiled is ready (or `timeout` s pass): what a step loop does when
        every request waits for its grammar, instead of spinning and taking the compile's CPU."""
        futures = [seq.structured.future for seq in self._compiling if seq.structured is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def prepare(self, sample_seqs: list[Sequence]) -> None:
        """Start filling the bitmask of this step's constrained rows, to overlap with the forward."""
        if self.processor is not None:
            self.processor.prepare(sample_seqs)

    def retry(
        self,
        seq: Sequence,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        requests: dict[str, Request],
    ) -> None:
        """Sample a relaxed grammar's output again after it failed validation: fresh grammar state, no output
        tokens, a new seed, and the forced prefix appended again."""
        request = seq.structured
        request.restart()
        self.num_retries += 1
        output_processor.restart(seq)
        seed = seq.params.seed if seq.params is not None else None
        if seed is not None:
            seq.generator = make_generator(
                seed + seq.index + request.retries * _RETRY_SEED_STRIDE, self.device
            )
        # A forced prefix cannot end the output here: the same prefix did not end it the first time.
        output_processor.begin(seq, incremental=_incremental(seq, requests))
        scheduler.restart(seq)

    def release(self, seq: Sequence) -> None:
        """Drop an aborted sequence's grammar (and its place in the compile queue)."""
        seq.structured = None
        if seq in self._compiling:
            self._compiling.remove(seq)

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()


def overlap_fills(device: torch.device) -> bool:
    """Whether mask fills should overlap the forward on the mask thread: with the forward on an accelerator, or
    with a CPU core that the forward's threads leave free (read when the processor is built, after the engine set
    its thread count)."""
    import torch

    from structgen.structured.backend import usable_cpus

    return device.type != "cpu" or usable_cpus() > torch.get_num_threads()


def _incremental(seq: Sequence, requests: dict[str, Request]) -> bool:
    request = requests.get(seq.request_id)
    return request is None or request.stream or bool(seq.params is not None and seq.params.stop)


def _grammar_of(seq: Sequence) -> object | None:
    request = seq.structured
    if request is None or (seq.reasoning is not None and seq.reasoning.thinking):
        return None  # reasoning runs free: the grammar starts with the answer
    return request.grammar


def _opening_token(seq: Sequence) -> int | None:
    # Before a reasoning model's first token: opening its reasoning is allowed besides the grammar's tokens.
    return seq.reasoning.opening_token_id if seq.reasoning is not None else None
