"""HTTP serving overhead: `--requests` concurrent structured chat requests (JSON Schemas from vLLM's samples)
through the OpenAI-compatible server (uvicorn on loopback, httpx async, streamed) vs the same workload through
the offline `LLM` API, in the same run on the same engine.

One `LLMEngine` serves both sides: `LLM.chat` drives it first, then an `AsyncEngine` over it backs the app. A
warm-up pass (every prompt, one token) fills the grammar compile cache and the prefix cache first, so neither
measured side pays for compiles or prompt prefixes the other did not. Greedy decoding on both sides.

    python benchmarks/server.py [--model tiny] [--requests 64] [--max-tokens 32] [--json OUT]

Reports requests/s and output tokens/s for each side, the server overhead ratio (HTTP wall time / offline wall
time) and the time to first token of the streamed HTTP requests (p50 / p99: arrival at the client to the first
content delta).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from structgen.bench import shared_data

SCHEMA_FILES = (
    "sample_json_schema.v1.json",
    "car_description.pydantic.schema.json",
    "sample_enum_json_schema.json",
    "reasoning_result.schema.json",
    "min_max_length.schema.json",
    "sample_definition_json_schema.v1.json",
)


def workload(n: int) -> list[tuple[list[dict[str, str]], dict[str, Any]]]:
    """`n` (messages, schema) pairs, cycling through the sample schemas; every prompt is distinct."""
    samples = shared_data() / "vllm-samples"
    schemas = [json.loads((samples / name).read_text()) for name in SCHEMA_FILES]
    items = []
    for i in range(n):
        schema = schemas[i % len(schemas)]
        title = schema.get("title", "record")
        text = f"Request {i}: write one realistic {title} as a JSON object."
        items.append(([{"role": "user", "content": text}], schema))
    return items


def run_offline(llm: Any, items: list[Any], max_tokens: int) -> dict[str, float]:
    from structgen import SamplingParams
    from structgen.structured import StructuredOutputsParams

    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0, structured_outputs=StructuredOutputsParams(json=s)
        )
        for _, s in items
    ]
    start = time.perf_counter()
    outputs = llm.chat([m for m, _ in items], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": wall, "tokens": tokens}


async def run_http(url: str, model: str, items: list[Any], max_tokens: int) -> dict[str, Any]:
    import httpx

    async def one(client: httpx.AsyncClient, messages: Any, schema: Any) -> tuple[float, int]:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
        }
        sent = time.perf_counter()
        ttft, tokens = None, 0
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - sent
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return (ttft if ttft is not None else time.perf_counter() - sent), tokens

    limits = httpx.Limits(max_connections=len(items), max_keepalive_connections=len(items))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, m, s) for m, s in items))
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    return {"wall_s": wall, "tokens": sum(n for _, n in results), "ttfts": ttfts}


def _percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


class _Uvicorn:
    """The app on a free loopback port in a background thread."""

    def __init__(self, app: Any) -> None:
        import socket

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="registry name (tiny) or None for the default SmolLM2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    import torch

    from structgen import LLM
    from structgen.engine.async_engine import AsyncEngine
    from structgen.server import build_app

    torch.set_num_threads(args.threads)
    items = workload(args.requests)
    # Built, and run offline, on the step thread: a model loaded or run on this thread and stepped on another
    # leaves two OpenMP teams, whose workers then sleep between ops (libgomp's throttled wait; see
    # `structgen.engine.async_engine`), which would slow the HTTP side with --threads 2.
    built: list[Any] = []

    def build() -> Any:
        built.append(LLM(model=args.model, device="cpu", kv_cache_tokens=32768, max_num_seqs=args.requests))
        return built[0].engine

    engine = AsyncEngine(build=build)
    llm = built[0]

    async def offline_runs() -> dict[str, float]:
        await engine.on_step_thread(lambda: run_offline(llm, items, 1))  # warm-up: grammars, prompt prefixes
        return await engine.on_step_thread(lambda: run_offline(llm, items, args.max_tokens))

    name = args.model or "smollm2-135m"
    try:
        offline = asyncio.run(offline_runs())
        with _Uvicorn(build_app(engine, llm.engine.tokenizer, model_name=name)) as url:
            http = asyncio.run(run_http(url, name, items, args.max_tokens))
    finally:
        engine.shutdown()
    n = args.requests
    result = {
        "model": name,
        "requests": n,
        "max_tokens": args.max_tokens,
        "offline": {
            "requests_per_s": round(n / offline["wall_s"], 2),
            "tokens_per_s": round(offline["tokens"] / offline["wall_s"], 1),
            "tokens": offline["tokens"],
            "wall_s": round(offline["wall_s"], 2),
        },
        "http": {
            "requests_per_s": round(n / http["wall_s"], 2),
            "tokens_per_s": round(http["tokens"] / http["wall_s"], 1),
            "tokens": http["tokens"],
            "wall_s": round(http["wall_s"], 2),
            "ttft_p50_s": round(statistics.median(http["ttfts"]), 3),
            "ttft_p99_s": round(_percentile(http["ttfts"], 0.99), 3),
        },
        "server_overhead_ratio": round(http["wall_s"] / offline["wall_s"], 3),
    }
    print(f"{'side':8} {'req/s':>8} {'tok/s':>8} {'tokens':>7} {'wall s':>7}")
    for side in ("offline", "http"):
        row = result[side]
        print(
            f"{side:8} {row['requests_per_s']:8} {row['tokens_per_s']:8} {row['tokens']:7} {row['wall_s']:7}"
        )
    print(f"server overhead ratio (HTTP wall / offline wall): {result['server_overhead_ratio']}")
    print(f"HTTP TTFT p50 {result['http']['ttft_p50_s']} s, p99 {result['http']['ttft_p99_s']} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
