"""Request state: a `Request` is what a user asked for; each of its `n` samples is a `Sequence`.

The scheduler and the block manager see only sequences: their tokens, how many of those already have KV in the
cache (`num_computed_tokens`) and their block table. A request with `n > 1` starts as one sequence; when its
prompt is computed it forks into `n` sequences that share the prompt's blocks.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from structgen.engine.metrics import RequestMetrics

if TYPE_CHECKING:
    import torch

    from structgen.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    # Waiting on something outside the engine (a grammar compiling); the scheduler skips it until `ready()`.
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    # Evicted from the cache to make room; waits at the front of the queue and recomputes its tokens.
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The request could not be served (its grammar failed to compile, a strict output stayed invalid...):
    # `Sequence.error` says why; the server answers it with a 400.
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Sequence:
    """One stream of tokens and its place in the KV cache.

    `token_ids` is prompt + output. The last sampled token has no KV yet: it is the input of the next step, so
    a running sequence has `num_computed_tokens == len(token_ids) - 1` between decode steps.
    """

    __slots__ = (
        "block_hashes",
        "block_table",
        "cumulative_logprob",
        "detokenizer",
        "error",
        "error_code",
        "finish_reason",
        "generator",
        "index",
        "logprobs",
        "lora",
        "max_tokens",
        "num_committed_blocks",
        "num_computed_tokens",
        "num_pending_forks",
        "num_prompt_tokens",
        "num_sent_chars",
        "num_sent_tokens",
        "output_text",
        "output_token_ids",
        "params",
        "prompt_logprobs",
        "prompt_token_ids",
        "ready",
        "reasoning",
        "request_id",
        "seq_id",
        "status",
        "stop_checker",
        "stop_reason",
        "structured",
        "token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        *,
        request_id: str = "",
        index: int = 0,
        params: SamplingParams | None = None,
        max_tokens: int | None = None,
        generator: torch.Generator | None = None,
        ready: Callable[[], bool] | None = None,
        num_forks: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.max_tokens = max_tokens
        self.generator = generator
        self.ready = ready
        self.status = SequenceStatus.WAITING if ready is None else SequenceStatus.WAITING_FOR_GRAMMAR
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        # KV-cache state, owned by the scheduler and the block manager.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of `token_ids`, filled lazily
        self.num_committed_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_pending_forks = num_forks
        # Output state, owned by the output processor.
        self.detokenizer: Any = None
        self.stop_checker: Any = None
        self.output_text = ""
        self.num_sent_tokens = 0  # how much of the output the last RequestOutput already carried
        self.num_sent_chars = 0
        self.logprobs: list[Any] | None = None
        self.cumulative_logprob = 0.0
        # With `params.prompt_logprobs`: the prompt tokens scored so far (`structgen.engine.prompt_logprobs`),
        # starting with None for the first token, which nothing precedes. Filled by the model runner.
        self.prompt_logprobs: list[Any] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # a machine-readable kind of `error`, e.g. "compile_timeout"
        # The request's grammar state (`structgen.structured.StructuredRequest`), None when unconstrained.
        self.structured: Any = None
        # With a reasoning parser: where the output stands between reasoning and answer
        # (`structgen.engine.reasoning.ReasoningState`); None without one.
        self.reasoning: Any = None
        # The LoRA adapter it runs with (`structgen.lora.manager.ServedLoRA`), None for the base model.
        self.lora: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, index={self.index}, "
            f"status={self.status.name}, tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt tokens still wait for their logprobs: the prefill must compute them, so the prefix cache
        serves it only blocks that kept their scores (`prompt_logprobs.cached_scored_prefix`)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= len(self.token_ids) - 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def fork(self, seq_id: int, index: int, generator: torch.Generator | None) -> Sequence:
        """A sibling sample with the same tokens and KV state; the block manager shares the blocks."""
        child = Sequence(
            seq_id,
            self.prompt_token_ids,
            request_id=self.request_id,
            index=index,
            params=self.params,
            max_tokens=self.max_tokens,
            generator=generator,
        )
        child.token_ids = list(self.token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_committed_blocks = self.num_committed_blocks
        child.status = self.status
        # Each sample walks its own copy of the grammar from the parent's state.
        child.structured = self.structured.fork() if self.structured is not None else None
        child.reasoning = self.reasoning.copy() if self.reasoning is not None else None
        child.lora = self.lora
        return child


class Request:
    """What one `add_request` call asked for, and the sequences that answer it."""

    __slots__ = ("metrics", "params", "prompt", "prompt_token_ids", "request_id", "seqs", "stream")

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = True,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream = stream
        self.seqs: list[Sequence] = []
        self.metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            num_prompt_tokens=len(prompt_token_ids),
        )

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and all(seq.is_finished for seq in self.seqs)
