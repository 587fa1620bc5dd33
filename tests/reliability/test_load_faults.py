"""Load with faults (issue 10, item 3), CI-sized: 40 concurrent clients against a real uvicorn on `tiny`, mixing
chat and text completions, streaming and plain, JSON-schema-constrained and free, 30% of them leaving at a
random point. Afterwards: no 5xx and no error, every structured output that finished validates, the engine
holds no request and every KV block is back in the pool, and the RSS is back within a bound of its start.
The 200-client run is `benchmarks/load.py` (results in BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from live_server import serve
from reliability_helpers import KEY, keyed_app

from structgen.bench.load import LoadSpec, engine_leaks, rss_mb, run_clients, summarize

CLIENTS = 40
RSS_BOUND_MB = 150.0
# Enough for the small schema's longest answer in cl100k tokens, so constrained outputs finish ("stop").
MAX_TOKENS = 16


def test_load_with_disconnects_leaks_nothing(server_tiny_engine: Any) -> None:
    spec = LoadSpec(
        clients=CLIENTS, max_tokens=MAX_TOKENS, disconnect_fraction=0.3, max_disconnect_delay_s=1.0, seed=3
    )
    with serve(keyed_app(server_tiny_engine)) as base:
        # Warm up first: one-time costs (first compiles, allocator growth) are not leaks.
        asyncio.run(
            run_clients(base, LoadSpec(clients=4, max_tokens=MAX_TOKENS, disconnect_fraction=0, api_key=KEY))
        )
        rss_start = rss_mb()
        spec.api_key = KEY
        results, wall_s = asyncio.run(run_clients(base, spec))
        leaks = asyncio.run(engine_leaks(server_tiny_engine, timeout_s=20))
    report = summarize(results, wall_s)
    assert report.problems == [] and leaks == []
    assert report.server_errors == 0 and report.error_events == 0
    # The mix really happened: planned disconnects, finished requests of each kind, validated JSON.
    assert sum(r.disconnect for r in results) >= CLIENTS // 5
    assert report.disconnected >= CLIENTS // 10
    finished = [r for r in results if r.finish_reason is not None and r.error is None]
    assert {(r.stream, r.structured) for r in finished} == {
        (s, j) for s in (False, True) for j in (False, True)
    }
    assert report.structured_valid >= 3 and report.structured_invalid == 0
    assert rss_mb() - rss_start < RSS_BOUND_MB
