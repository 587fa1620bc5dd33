"""Load with faults: many concurrent clients against a live server, a share of them leaving mid-request.

    structgen bench load [--clients 200] [--model tiny|smollm2-135m | --url URL] [--max-tokens 16]
                         [--disconnect 0.3] [--no-baseline] [--json OUT.json]

Each client sends one request (chat or text completion, streaming or not, constrained by a small JSON schema or
plain); `--disconnect` of them close the connection at a random point (before the answer, or after a few SSE
chunks). The checks: no 5xx, no error events, every structured output that finished validates (jsonschema);
for a server started in-process also that the engine holds no request, every KV block is back in the pool, and
the RSS is back within `--rss-bound-mb` of its value before the load. The baseline is the same load without
disconnects, run first; the ratio compares the requests/s of the faulty run to it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# Small enough that a constrained answer always fits in `max_tokens`, even from random weights.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
_IDLE_TIMEOUT_S = 60.0


@dataclass(slots=True, kw_only=True)
class LoadSpec:
    clients: int = 200
    max_tokens: int = 16
    disconnect_fraction: float = 0.3
    stream_fraction: float = 0.5
    structured_fraction: float = 0.5
    # A disconnecting client leaves after a delay in [0, this), or after 0-3 SSE chunks.
    max_disconnect_delay_s: float = 2.0
    seed: int = 0
    api_key: str | None = None
    request_timeout_s: float = 600.0


@dataclass(slots=True)
class ClientResult:
    stream: bool
    structured: bool
    disconnect: bool  # planned to leave early
    status: int | None = None  # None: left (or failed) before the response started
    latency_s: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # an error body or event, or a transport failure


@dataclass(slots=True)
class LoadReport:
    clients: int
    wall_s: float
    completed: int
    disconnected: int
    statuses: dict[str, int]
    server_errors: int
    error_events: int
    structured_valid: int
    structured_invalid: int
    structured_truncated: int
    requests_per_s: float
    p50_latency_s: float
    p99_latency_s: float
    problems: list[str] = field(default_factory=list)


# -- clients --------------------------------------------------------------------------------------------------


def _request(
    i: int, rng: random.Random, spec: LoadSpec, *, stream: bool, structured: bool
) -> tuple[str, Any]:
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, "stream": stream, "temperature": 1.0, "seed": i}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"Client {i}: describe a box as JSON."}]
        if structured:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "box", "schema": SCHEMA},
            }
        return "/v1/chat/completions", body
    body["prompt"] = f"Client {i} says:"
    if structured:
        body["guided_json"] = SCHEMA
    return "/v1/completions", body


def _delta(event: dict[str, Any], result: ClientResult) -> None:
    for choice in event.get("choices", ()):
        result.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        result.finish_reason = choice.get("finish_reason") or result.finish_reason


async def _one(http: httpx.AsyncClient, i: int, rng: random.Random, spec: LoadSpec) -> ClientResult:
    result = ClientResult(
        stream=rng.random() < spec.stream_fraction,
        structured=rng.random() < spec.structured_fraction,
        disconnect=rng.random() < spec.disconnect_fraction,
    )
    path, body = _request(i, rng, spec, stream=result.stream, structured=result.structured)
    leave_after_chunks = (
        rng.randrange(4) if result.disconnect and result.stream and rng.random() < 0.5 else None
    )
    delay = rng.uniform(0, spec.max_disconnect_delay_s) if result.disconnect else None
    if leave_after_chunks is not None:
        delay = None
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_exchange(http, path, body, result, leave_after_chunks), delay)
    except TimeoutError:  # the planned disconnect: cancelling the exchange closes the connection
        pass
    except (httpx.HTTPError, ValueError) as error:  # a transport failure, or a body that is not JSON
        result.error = f"{type(error).__name__}: {error}"
    result.latency_s = time.perf_counter() - start
    return result


async def _exchange(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], result: ClientResult, leave_after: int | None
) -> None:
    async with http.stream("POST", path, json=body) as response:
        result.status = response.status_code
        if response.status_code != 200 or not result.stream:
            data = json.loads(await response.aread())
            if "error" in data:
                result.error = data["error"].get("message", "?")
            else:
                _delta({"choices": [c | {"delta": c.get("message")} for c in data["choices"]]}, result)
            return
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result.error = event["error"].get("message", "?")
            _delta(event, result)
            chunks += 1
            if leave_after is not None and chunks > leave_after:
                return  # leaving the `with` closes the half-read response: a disconnect mid-stream


async def run_clients(base_url: str, spec: LoadSpec) -> tuple[list[ClientResult], float]:
    """Every client at once; the results (in client order) and the wall time."""
    rng = random.Random(spec.seed)
    seeds = [rng.randrange(2**32) for _ in range(spec.clients)]
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=spec.clients, max_keepalive_connections=0)
    timeout = httpx.Timeout(spec.request_timeout_s, connect=60.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as http:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_one(http, i, random.Random(seeds[i]), spec) for i in range(spec.clients))
        )
    return list(results), time.perf_counter() - start


# -- checks ---------------------------------------------------------------------------------------------------


def summarize(results: list[ClientResult], wall_s: float) -> LoadReport:
    import jsonschema

    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    done = [r for r in results if r.status == 200 and r.finish_reason is not None and r.error is None]
    problems = []
    valid = invalid = truncated = 0
    for r in (r for r in done if r.structured):
        if r.finish_reason != "stop":
            truncated += 1
            continue
        try:
            jsonschema.validate(json.loads(r.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as error:
            invalid += 1
            problems.append(f"structured output does not validate: {r.text!r} ({error})")
    server_errors = sum(1 for r in results if r.status is not None and r.status >= 500)
    error_events = sum(1 for r in results if r.status == 200 and r.error is not None)
    for r in results:
        if r.error is not None and not r.disconnect:
            problems.append(f"status {r.status}: {r.error}")
    if server_errors:
        problems.append(f"{server_errors} responses with a 5xx status")
    latencies = sorted(r.latency_s for r in done) or [0.0]
    return LoadReport(
        clients=len(results),
        wall_s=wall_s,
        completed=len(done),
        disconnected=sum(1 for r in results if r.disconnect and r not in done),
        statuses=statuses,
        server_errors=server_errors,
        error_events=error_events,
        structured_valid=valid,
        structured_invalid=invalid,
        structured_truncated=truncated,
        requests_per_s=len(done) / wall_s if wall_s > 0 else 0.0,
        p50_latency_s=statistics.median(latencies),
        p99_latency_s=latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        problems=problems,
    )


async def engine_leaks(engine: Any, *, timeout_s: float = _IDLE_TIMEOUT_S) -> list[str]:
    """What an `AsyncEngine` still holds once every client is gone (waits up to `timeout_s` for it to drain):
    empty when every request left and every KV block is back in the pool."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await engine.stats()
        busy = stats.num_running + stats.num_waiting + stats.num_waiting_for_grammar
        if (busy == 0 and stats.kv_blocks_used == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    leaks = []
    if busy:
        leaks.append(f"{busy} requests stuck in the engine")
    if stats.kv_blocks_used:
        leaks.append(f"{stats.kv_blocks_used} of {stats.kv_blocks_total} KV blocks not back in the pool")
    return leaks


def rss_mb() -> float:
    """This process's resident set size, MiB (from `/proc` on Linux, else psutil), after a garbage collection."""
    gc.collect()
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


# -- the in-process server ------------------------------------------------------------------------------------


@contextmanager
def local_server(app: Any) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port in a daemon thread; yields the base URL."""
    import socket

    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", backlog=4096)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="bench-load-server", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the benchmark server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _engine(args: argparse.Namespace) -> Any:
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.async_engine import AsyncEngine

    config = EngineConfig(
        model=args.model,
        device=args.device,
        cache=CacheConfig(kv_cache_tokens=args.kv_cache_tokens),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
    )
    return AsyncEngine.from_config(config)


def _print(name: str, report: LoadReport) -> None:
    print(
        f"{name:>9} | {report.clients:>7} | {report.completed:>9} | {report.disconnected:>6} | "
        f"{report.server_errors:>3} | {report.structured_valid:>5}/{report.structured_invalid}/"
        f"{report.structured_truncated:<5} | {report.requests_per_s:>6.2f} | {report.p50_latency_s:>7.2f} | "
        f"{report.p99_latency_s:>7.2f} | {report.statuses}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structgen bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--model", default="tiny", help="tiny (default) or smollm2-135m, started in-process")
    parser.add_argument("--url", default=None, help="load this running server instead (HTTP checks only)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of clients that leave early")
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--rss-bound-mb", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without disconnects")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    if args.clients < 1 or not 0 <= args.disconnect <= 1:
        print("structgen bench load: --clients must be >= 1 and --disconnect in [0, 1]", file=sys.stderr)
        return 2
    spec = LoadSpec(
        clients=args.clients,
        max_tokens=args.max_tokens,
        disconnect_fraction=args.disconnect,
        seed=args.seed,
        api_key=args.api_key,
    )
    try:
        engine = None if args.url else _engine(args)
    except (ValueError, OSError) as error:  # an unknown model, a bad size
        print(f"structgen bench load: {error}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {
        "clients": args.clients,
        "model": args.url or args.model,
        "max_tokens": args.max_tokens,
    }
    with _serving(engine, args) as url:
        reports: dict[str, LoadReport] = {}
        print(
            "      run | clients | completed | left | 5xx | json ok/bad/cut | req/s | p50 (s) | p99 (s) | statuses"
        )
        if (
            engine is not None
        ):  # warm up: first-request costs (compiles, allocations) are not part of the load
            asyncio.run(
                run_clients(url, LoadSpec(clients=8, max_tokens=args.max_tokens, disconnect_fraction=0))
            )
        rss_start = rss_mb()
        if not args.no_baseline:
            base = LoadSpec(**{**asdict(spec), "disconnect_fraction": 0.0})
            reports["baseline"] = summarize(*asyncio.run(run_clients(url, base)))
            _print("baseline", reports["baseline"])
        reports["faults"] = summarize(*asyncio.run(run_clients(url, spec)))
        _print("faults", reports["faults"])
        problems = list(reports["faults"].problems) + list(
            reports.get("baseline", reports["faults"]).problems
        )
        if engine is not None:
            problems += asyncio.run(engine_leaks(engine))
            rss_end = rss_mb()
            out["rss_mb"] = {"start": round(rss_start, 1), "end": round(rss_end, 1)}
            print(
                f"RSS: {rss_start:.0f} MiB before the load, {rss_end:.0f} MiB after (bound +{args.rss_bound_mb:.0f})"
            )
            if rss_end - rss_start > args.rss_bound_mb:
                problems.append(f"RSS grew by {rss_end - rss_start:.0f} MiB")
    if "baseline" in reports and reports["baseline"].requests_per_s:
        ratio = reports["faults"].requests_per_s / reports["baseline"].requests_per_s
        out["ratio_faults_over_baseline"] = round(ratio, 3)
        print(f"requests/s with disconnects / without: {ratio:.2f}")
    out |= {name: asdict(report) for name, report in reports.items()}
    out["problems"] = problems
    for problem in problems[:20]:
        print(f"PROBLEM: {problem}")
    print("checks: " + ("all passed" if not problems else f"{len(problems)} problem(s)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if engine is not None:
        engine.shutdown()
    return 1 if problems else 0


@contextmanager
def _serving(engine: Any, args: argparse.Namespace) -> Iterator[str]:
    if engine is None:
        yield args.url.rstrip("/")
        return
    from structgen.server import build_app

    app = build_app(engine, engine.engine.tokenizer, model_name=args.model, api_key=args.api_key)
    with local_server(app) as url:
        yield url
