"""Part (s) through HTTP (`structgen bench structured --parts s --http`): the shapes of `structured_shapes`
through the OpenAI server, JSON Schema vs unconstrained, on one server and one engine.

One fresh `LLMEngine` behind an `AsyncEngine` and `build_app`, uvicorn on a free loopback port in a thread (as
`structgen bench server` does). Per shape, `--concurrency` client workers (httpx async) each loop
non-streamed chat completions until the side's share of `--requests` is done: `response_format` json_schema
on one side, none and `ignore_eos: true` (vLLM's extra field) on the other, temperature 1, `max_tokens`,
a distinct prompt and seed per request. The sides alternate over `--passes` passes (the first side of a pass
alternates too), so drift and the engine's warm state hit both alike; each side's time is the sum of the wall
times of its own passes. A warm-up request per side first compiles the schema.

Tokens: `usage.completion_tokens` counts every output token; the forced (jump-forward) ones come from each
choice's `structured.forced_tokens`, so sampled = completion - forced (a budget-closed output also dropped
one sampled token for its completion: off by one for those). Prompts differ between the sides (a tag in
the prompt) so neither side hits the other's prompts in the shared prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from structgen.bench.structured_engine import make_engine
from structgen.bench.structured_shapes import SEED, SHAPES, Tally, prompt, ratios, validator

# The two sides, in the order of even passes.
SIDES = ("unconstrained", "json")


def _body(name: str, shape: str, index: int, *, side: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": name,
        "messages": [{"role": "user", "content": prompt(shape, index, tag=side[0])}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": SEED + index,
    }
    if side == "json":
        schema = SHAPES[shape]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": shape, "schema": schema}}
    else:
        body["ignore_eos"] = True  # never ends early: the conservative baseline, as in process
    return body


async def _pass(
    client: Any,
    name: str,
    shape: str,
    indices: range,
    *,
    side: str,
    concurrency: int,
    max_tokens: int,
    tally: Tally,
    check: Any | None,
) -> None:
    """Run the requests `indices` of one side with `concurrency` workers; adds to `tally`."""
    pending = iter(indices)  # shared by the workers: next() never awaits, so each index goes out once

    async def worker() -> None:
        for index in pending:
            response = await client.post(
                "/v1/chat/completions", json=_body(name, shape, index, side=side, max_tokens=max_tokens)
            )
            response.raise_for_status()
            data = response.json()
            choice = data["choices"][0]
            report = choice.get("structured")
            if report is not None and "forced_tokens" not in report:
                raise RuntimeError(
                    "the server's structured report has no forced_tokens: sampled tokens unknown"
                )
            forced = report["forced_tokens"] if report is not None else 0
            tally.forced += forced
            tally.sampled += data["usage"]["completion_tokens"] - forced
            tally.count(choice["message"].get("content") or "", choice["finish_reason"], check)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.seconds += time.perf_counter() - start


async def _shape(
    url: str, name: str, shape: str, *, requests: int, passes: int, **options: Any
) -> dict[str, Any]:
    import httpx

    concurrency = options["concurrency"]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    tallies = {side: Tally() for side in SIDES}
    checks = {"unconstrained": None, "json": validator(SHAPES[shape])}
    per_pass = max(1, requests // passes)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        for side in SIDES:  # warm-up: the schema compiled, the server's paths exercised once
            await _pass(
                client,
                name,
                shape,
                range(-1, 0),
                side=side,
                concurrency=1,
                max_tokens=8,
                tally=Tally(),
                check=None,
            )
        for p in range(passes):
            for side in SIDES if p % 2 == 0 else SIDES[::-1]:
                indices = range(p * per_pass, (p + 1) * per_pass)
                await _pass(
                    client,
                    name,
                    shape,
                    indices,
                    side=side,
                    tally=tallies[side],
                    check=checks[side],
                    **options,
                )
    return ratios(tallies["unconstrained"], tallies["json"], report=_side)


def _side(tally: Tally) -> dict[str, Any]:
    """A side's counts for the report (no steps or prefill counts: the client does not see them)."""
    keep = ("seconds", "sampled", "forced", "finished", "stop", "length", "errors", "valid", "invalid")
    return {key: round(getattr(tally, key), 3) for key in keep}


def run_http(
    model: str | None, shapes: list[str], *, requests: int, passes: int, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """{shape: result} measured through the server (see the module's docstring)."""
    from structgen.bench.server import _Uvicorn
    from structgen.engine.async_engine import AsyncEngine
    from structgen.server import build_app

    kv = max(32768, 2 * concurrency * (max_tokens + 64))
    engine = AsyncEngine(
        make_engine(model, jump_forward=True, max_num_seqs=max(64, concurrency), kv_cache_tokens=kv)
    )
    name = model or "smollm2-135m"
    options = {"concurrency": concurrency, "max_tokens": max_tokens}
    try:
        with _Uvicorn(build_app(engine, engine.engine.tokenizer, model_name=name)) as url:
            return {
                shape: asyncio.run(_shape(url, name, shape, requests=requests, passes=passes, **options))
                for shape in shapes
            }
    finally:
        engine.shutdown()
