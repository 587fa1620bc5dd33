"""Counters and timings the engine keeps about itself; the server exports them (Prometheus) later.

`EngineStats` is a snapshot built on demand (`LLMEngine.stats()`): gauges read from the scheduler and the block
manager, counters accumulated since start. `RequestMetrics` follows one request from arrival to finish.
All times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structgen.engine.llm_engine import LLMEngine
    from structgen.engine.scheduler import SchedulerOutput
    from structgen.engine.sequence import Request


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_output_tokens: int = 0  # over all `n` samples
    max_sample_tokens: int = 0  # of the longest sample: the stream TPOT is measured on

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None until a second token exists)."""
        if self.first_token_time is None or self.last_token_time is None or self.max_sample_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.max_sample_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters the engine updates as it steps (preemptions and prefix-cache counts live in the
    scheduler and the block manager, where they happen)."""

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0  # prefill tokens run through the model (cache hits excluded)
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    # The most recent finished requests, for latency histograms and tests; bounded so a server never grows.
    finished_requests: deque[RequestMetrics] = field(default_factory=lambda: deque(maxlen=4096))


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A point-in-time view of the engine."""

    num_running: int
    num_waiting: int
    num_waiting_for_grammar: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_block_size: int
    num_steps: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_preemptions: int
    num_requests_finished: int
    num_requests_aborted: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    # Structured output: tokens appended by jump-forward (never sampled), resamples of outputs that failed
    # validation, and sampled tokens a grammar rejected (each a backend bug; the request fails).
    num_jump_forward_tokens: int = 0
    num_structured_retries: int = 0
    num_grammar_errors: int = 0
    # Speculative decoding: proposed tokens the target model verified, and those it accepted.
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_method: str | None = None  # the speculative method ("ngram", "draft_model"); None: off
    # LoRA (None: off): the adapters of running and of waiting requests (names, sorted), the slots, how many
    # adapters are registered, and how often one was put into a slot / pushed out of one.
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int | None = None
    num_loras_registered: int = 0
    num_lora_slot_loads: int = 0
    num_lora_evictions: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queried_tokens:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens


def engine_stats(engine: LLMEngine) -> EngineStats:
    """The engine's gauges and counters now (`LLMEngine.stats`)."""
    bm, sched, c = engine.block_manager, engine.scheduler, engine.counters
    spec = engine.speculator.counters if engine.speculator is not None else None
    lora = engine.lora
    num_grammar = sched.num_waiting_for_grammar
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting) - num_grammar,
        num_waiting_for_grammar=num_grammar,
        kv_blocks_total=bm.num_blocks,
        kv_blocks_used=bm.num_used_blocks,
        kv_blocks_free=bm.num_free_blocks,
        kv_block_size=bm.block_size,
        num_steps=c.num_steps,
        num_prompt_tokens_computed=c.num_prompt_tokens_computed,
        num_generated_tokens=c.num_generated_tokens,
        num_preemptions=sched.num_preemptions,
        num_requests_finished=c.num_requests_finished,
        num_requests_aborted=c.num_requests_aborted,
        prefix_cache_queried_tokens=bm.num_queried_tokens,
        prefix_cache_hit_tokens=bm.num_hit_tokens,
        prefix_cache_evictions=bm.num_evictions,
        num_jump_forward_tokens=engine.output_processor.num_forced_tokens,
        num_structured_retries=engine.structured.num_retries,
        num_grammar_errors=engine.output_processor.num_grammar_errors,
        num_spec_proposed_tokens=spec.num_proposed if spec is not None else 0,
        num_spec_accepted_tokens=spec.num_accepted if spec is not None else 0,
        spec_method=engine.speculator.config.method if engine.speculator is not None else None,
        lora_running=_adapter_names(sched.running),
        lora_waiting=_adapter_names(sched.waiting),
        max_loras=lora.config.max_loras if lora is not None else None,
        num_loras_registered=len(lora.registered()) if lora is not None else 0,
        num_lora_slot_loads=lora.num_slot_loads if lora is not None else 0,
        num_lora_evictions=lora.num_evictions if lora is not None else 0,
    )


def _adapter_names(seqs: Iterable[Any]) -> tuple[str, ...]:
    return tuple(sorted({seq.lora.name for seq in seqs if seq.lora is not None}))


def note_scheduled(batch: SchedulerOutput, requests: dict[str, Request], counters: EngineCounters) -> None:
    """Record a scheduled step: first-scheduled times and prefix-cache hits of newly admitted requests, and the
    prompt tokens computed (everything but plain decodes)."""
    now = time.monotonic()
    for seq in batch.newly_scheduled:
        metrics = requests[seq.request_id].metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
            # Prompt tokens only: tokens a grammar forced at the start of the output join the sequence
            # before its first forward, and hit the cache when an earlier request wrote the same ones.
            metrics.num_cached_tokens = min(seq.num_computed_tokens, len(seq.prompt_token_ids))
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        # A decode is one token right after the last sampled one; everything else is (re)prefill.
        if not (num_new == 1 and seq.num_output_tokens and seq.num_computed_tokens == len(seq) - 1):
            counters.num_prompt_tokens_computed += num_new
