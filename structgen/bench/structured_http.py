"""Part (s) through HTTP (`structgen bench structured --parts s --http`): the shapes of `structured_shapes`
through the OpenAI server, JSON Schema vs unconstrained, on one server and one engine.

One fresh `LLMEngine` behind an `AsyncEngine` and `build_app`, uvicorn on a free loopback port in a thread (as
`structgen bench server` does). Per shape and side, a closed loop as in process: `--concurrency` client workers
(httpx async) each keep one non-streamed chat completion in flight, sending the next (a new prompt and seed)
as soon as one returns: `response_format` json_schema on one side, none and `ignore_eos: true` (vLLM's extra
field) on the other, temperature 1, `max_tokens`. A window opens at a step boundary `WARMUP_STEPS` steps after
the side's first step and closes `--http-steps` steps later; then the workers are cancelled (their
connections close and the server aborts what they had in flight) and the engine drains before the other side
starts. The sides alternate over `--passes` windows each (the first side of a pass alternates too), so drift
and the engine's warm state hit both alike. A warm-up request per side first compiles the schema.

Why windows and not a fixed set of requests: with one wave of requests per pass the batch empties as they
finish, and a side whose outputs vary in length (the JSON one: `nested` stops after ~60 tokens, give or take
30) spent its tail at a fraction of the batch while the unconstrained side (all `max_tokens` long) ran full
to the end: the ratio measured the tail, and moved by 4-10 points between runs.

Tokens: read off the engine's own counters at the window's two step boundaries, as in process: sampled rows
(`counters.num_generated_tokens`) and jump-forward tokens (`output_processor.num_forced_tokens`). The outputs
that finished inside the window are checked with `jsonschema`. Prompts differ between the sides (a tag in the
prompt) so neither side hits the other's prompts in the shared prefix cache.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from structgen.bench.structured_engine import make_engine
from structgen.bench.structured_shapes import SEED, SHAPES, WARMUP_STEPS, Tally, prompt, ratios, validator

# The two sides, in the order of even passes.
SIDES = ("unconstrained", "json")
_POLL_S = 0.002  # how often the client looks at the engine's step counter
_DRAIN_TIMEOUT_S = 120.0


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


class _Counters:
    """The served engine's step, sampled-token and forced-token counts (plain ints: read from this thread)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def read(self) -> tuple[int, int, int]:
        llm = self.engine.engine
        return (
            llm.counters.num_steps,
            llm.counters.num_generated_tokens,
            llm.output_processor.num_forced_tokens,
        )

    async def boundary(self, after: int) -> tuple[float, tuple[int, int, int]]:
        """The time and counts at the first step boundary once `after` steps have run (polled)."""
        while True:
            now = self.read()
            if now[0] >= after:
                return time.perf_counter(), now
            await asyncio.sleep(_POLL_S)

    async def drained(self) -> None:
        deadline = time.perf_counter() + _DRAIN_TIMEOUT_S
        while self.engine.engine.has_unfinished():
            if time.perf_counter() > deadline:
                raise RuntimeError("the server still had requests in flight after its clients left")
            await asyncio.sleep(0.01)


async def _window(
    client: Any,
    counters: _Counters,
    name: str,
    shape: str,
    indices: Any,
    *,
    side: str,
    concurrency: int,
    max_tokens: int,
    steps: int,
    tally: Tally,
    check: Any | None,
) -> None:
    """One side's closed loop for one window of `steps` engine steps; adds to `tally`."""
    counting = False

    async def worker() -> None:
        while True:
            body = _body(name, shape, next(indices), side=side, max_tokens=max_tokens)
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            choice = response.json()["choices"][0]
            if counting:
                tally.count(choice["message"].get("content") or "", choice["finish_reason"], check)

    first = counters.read()[0]
    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    try:
        start_s, start = await _first_of(workers, counters.boundary(first + 1 + WARMUP_STEPS))
        counting = True
        end_s, end = await _first_of(workers, counters.boundary(start[0] + steps))
        counting = False
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    await counters.drained()
    tally.seconds += end_s - start_s
    tally.steps += end[0] - start[0]
    tally.sampled += end[1] - start[1]
    tally.forced += end[2] - start[2]


async def _first_of(workers: list[asyncio.Future[None]], wait: Any) -> Any:
    """`wait`'s result, unless a worker fails first (an HTTP error): then that error."""
    waiting = asyncio.ensure_future(wait)
    done, _ = await asyncio.wait([waiting, *workers], return_when=asyncio.FIRST_COMPLETED)
    if waiting not in done:
        waiting.cancel()
        for task in done:
            task.result()  # raises the worker's error
        raise RuntimeError("a client worker stopped")  # (workers only end by raising)
    return waiting.result()


async def _shape(
    url: str, engine: Any, name: str, shape: str, *, passes: int, **options: Any
) -> dict[str, Any]:
    import httpx

    concurrency = options["concurrency"]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    tallies = {side: Tally() for side in SIDES}
    checks = {"unconstrained": None, "json": validator(SHAPES[shape])}
    indices = {side: itertools.count() for side in SIDES}  # a new prompt and seed per request, per side
    counters = _Counters(engine)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        for side in SIDES:  # warm-up: the schema compiled, the server's paths exercised once
            response = await client.post(
                "/v1/chat/completions", json=_body(name, shape, -1, side=side, max_tokens=8)
            )
            response.raise_for_status()
        for p in range(passes):
            for side in SIDES if p % 2 == 0 else SIDES[::-1]:
                await _window(
                    client,
                    counters,
                    name,
                    shape,
                    indices[side],
                    side=side,
                    tally=tallies[side],
                    check=checks[side],
                    **options,
                )
    return ratios(tallies["unconstrained"], tallies["json"], report=_side)


def _side(tally: Tally) -> dict[str, Any]:
    """A side's counts for the report (no prefill counts: the window reads only steps and output tokens)."""
    keep = (
        "seconds",
        "steps",
        "sampled",
        "forced",
        "finished",
        "stop",
        "length",
        "errors",
        "valid",
        "invalid",
    )
    return {key: round(getattr(tally, key), 3) for key in keep}


def run_http(
    model: str | None, shapes: list[str], *, steps: int, passes: int, concurrency: int, max_tokens: int
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
    options = {"concurrency": concurrency, "max_tokens": max_tokens, "steps": steps}
    try:
        with _Uvicorn(build_app(engine, engine.engine.tokenizer, model_name=name)) as url:
            return {
                shape: asyncio.run(_shape(url, engine, name, shape, passes=passes, **options))
                for shape in shapes
            }
    finally:
        engine.shutdown()
