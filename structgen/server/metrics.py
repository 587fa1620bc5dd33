"""`GET /metrics`: Prometheus text for one app, from its own `CollectorRegistry` (several apps in one process,
as in the tests, never clash).

Engine gauges and counters are read at scrape time (`AsyncEngine.stats()`, the structured-output manager's
cache counts); latency and compile-time histograms are fed at scrape time from the bounded lists of recent
finished requests and compiles the engine keeps (observations past those bounds between two scrapes are lost,
never double counted). HTTP requests, the structured serving path of each output, the outputs closed at their
budget and the loops the guard ended are counted as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from structgen.engine.async_engine import AsyncEngine
    from structgen.engine.metrics import EngineStats
    from structgen.engine.outputs import CompletionOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(
        self, engine: AsyncEngine, *, in_flight: Callable[[], int], queued: Callable[[], int]
    ) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "structgen_http_requests",
            "HTTP requests by route, method and status code",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.structured_outputs = Counter(
            "structgen_structured_outputs",
            "Finished structured outputs by serving path (exact / rewritten / restricted / relaxed) and validity",
            ["path", "valid"],
            registry=self.registry,
        )
        # Counted from the finished choices' reports (`StructuredReport`), like the serving paths above.
        self.closed_at_budget = Counter(
            "structgen_structured_closed_at_budget",
            "Structured outputs steered onto their shortest valid completion as the tokens left ran out",
            registry=self.registry,
        )
        self.loops_ended = Counter(
            "structgen_structured_loops_ended",
            "Values inside structured outputs that the loop guard ended (the model repeated the same tokens)",
            registry=self.registry,
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Time per output token", _TPOT_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        self.compile_time = self._histogram(
            "grammar_compile_seconds", "Structured-output grammar compile time", _COMPILE_BUCKETS
        )
        self._collector = _EngineCollector(engine, in_flight=in_flight, queued=queued)
        self.registry.register(self._collector)
        counters = engine.engine.counters
        self._finished_seen = counters.num_requests_finished
        self._compiles_seen = 0

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(f"structgen_{name}", doc, buckets=buckets, registry=self.registry)

    def observe_outputs(self, finals: list[CompletionOutput]) -> None:
        for output in finals:
            report = output.structured
            if report is not None and report.path is not None:
                valid = "unknown" if report.valid is None else str(report.valid).lower()
                self.structured_outputs.labels(report.path, valid).inc()
            if report is not None:
                if report.closed_at_budget:
                    self.closed_at_budget.inc()
                if report.loops_ended:
                    self.loops_ended.inc(report.loops_ended)

    async def render(self) -> bytes:
        self._collector.stats = await self.engine.stats()
        self._feed_histograms()
        return generate_latest(self.registry)

    def _feed_histograms(self) -> None:
        counters = self.engine.engine.counters
        total = counters.num_requests_finished
        for metrics in _newest(counters.finished_requests, total - self._finished_seen):
            for histogram, value in (
                (self.ttft, metrics.ttft),
                (self.tpot, metrics.tpot),
                (self.e2e, metrics.e2e_latency),
            ):
                if value is not None:
                    histogram.observe(value)
        self._finished_seen = total
        manager = self.engine.engine.structured.manager
        if manager is not None:
            compiles = manager.stats.compiles
            for seconds in _newest(manager.stats.recent_compile_times, compiles - self._compiles_seen):
                self.compile_time.observe(seconds)
            self._compiles_seen = compiles


def _newest(recent: Sequence[Any], count: int) -> list[Any]:
    """The last `count` items of a bounded list (fewer when some already fell off its front)."""
    items = list(recent)  # one C-level copy: safe against the step thread appending meanwhile
    return items[len(items) - min(count, len(items)) :] if count > 0 else []


class _EngineCollector(Collector):
    """Engine gauges and counters, from the snapshot `ServerMetrics.render` takes just before collecting."""

    def __init__(
        self, engine: AsyncEngine, *, in_flight: Callable[[], int], queued: Callable[[], int]
    ) -> None:
        self.engine = engine
        self.in_flight = in_flight
        self.queued = queued
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats if self.stats is not None else self.engine.engine.stats()
        gauges = {
            "requests_running": ("Requests running in the engine", s.num_running),
            "requests_waiting": ("Requests waiting to be scheduled", s.num_waiting),
            "requests_waiting_for_grammar": (
                "Requests waiting for their grammar to compile",
                s.num_waiting_for_grammar,
            ),
            "http_requests_in_flight": ("Generation requests the server is answering", self.in_flight()),
            "http_requests_queued": (
                "Accepted requests without a first token yet (admission control)",
                self.queued(),
            ),
            "kv_blocks_total": ("KV cache blocks", s.kv_blocks_total),
            "kv_blocks_used": ("KV cache blocks in use", s.kv_blocks_used),
            "kv_blocks_free": (
                "KV cache blocks free (cached ones no request holds included)",
                s.kv_blocks_free,
            ),
            "kv_cache_usage_ratio": ("Fraction of KV cache blocks in use", s.kv_cache_usage),
            "prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache / queried",
                s.prefix_cache_hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"structgen_{name}", doc, value=value)
        counters = {
            "prompt_tokens": (
                "Prompt tokens prefilled (prefix-cache hits excluded)",
                s.num_prompt_tokens_computed,
            ),
            "generation_tokens": ("Tokens sampled", s.num_generated_tokens),
            "preemptions": ("Sequences preempted for KV space", s.num_preemptions),
            "requests_finished": ("Requests finished in the engine", s.num_requests_finished),
            "requests_aborted": ("Requests aborted in the engine", s.num_requests_aborted),
            "prefix_cache_queried_tokens": (
                "Prompt tokens looked up in the prefix cache",
                s.prefix_cache_queried_tokens,
            ),
            "prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache", s.prefix_cache_hit_tokens),
            "jump_forward_tokens": (
                "Tokens a grammar forced (appended without sampling)",
                s.num_jump_forward_tokens,
            ),
            "structured_retries": (
                "Resamples of relaxed outputs that failed validation",
                s.num_structured_retries,
            ),
        }
        if s.spec_method is not None:  # by method, as a label (one method per server)
            for name, doc, value in (
                (
                    "num_draft_tokens",
                    "Speculative tokens proposed and verified by the model",
                    s.num_spec_proposed_tokens,
                ),
                ("num_accepted_tokens", "Speculative tokens the model accepted", s.num_spec_accepted_tokens),
            ):
                family = CounterMetricFamily(f"structgen_spec_decode_{name}", doc, labels=["method"])
                family.add_metric([s.spec_method], value)
                yield family
            rate = GaugeMetricFamily(
                "structgen_spec_decode_acceptance_rate",
                "Accepted / proposed speculative tokens",
                labels=["method"],
            )
            proposed = s.num_spec_proposed_tokens
            rate.add_metric([s.spec_method], s.num_spec_accepted_tokens / proposed if proposed else 0.0)
            yield rate
        manager = self.engine.engine.structured.manager
        cache = manager.stats if manager is not None else None
        counters |= {
            "grammar_cache_hits": ("Grammar compile cache hits", cache.hits if cache else 0),
            "grammar_cache_misses": ("Grammar compile cache misses", cache.misses if cache else 0),
            "grammar_compile_failures": ("Grammar compiles that failed", cache.failures if cache else 0),
        }
        if s.max_loras is not None:
            counters |= {
                "lora_slot_loads": ("LoRA adapters put into a slot of the model", s.num_lora_slot_loads),
                "lora_evictions": ("LoRA adapters pushed out of a slot for another", s.num_lora_evictions),
            }
            yield GaugeMetricFamily(
                "structgen_lora_adapters_registered",
                "LoRA adapters loaded (servable)",
                value=s.num_loras_registered,
            )
            # vLLM's `lora_requests_info`: the adapters of running and waiting requests as labels.
            info = GaugeMetricFamily(
                "structgen_lora_requests_info",
                "LoRA adapters of running and waiting requests (labels), and the slots",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            info.add_metric([",".join(s.lora_running), ",".join(s.lora_waiting), str(s.max_loras)], 1)
            yield info
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"structgen_{name}", doc, value=value)
