"""Part (s) through HTTP (`structgen bench structured --parts s --http`): the shapes of `structured_shape_schemas`
through the OpenAI server, JSON Schema vs unconstrained, on one server and one engine.

One fresh `LLMEngine` behind an `AsyncEngine` and `build_app`, uvicorn on a free loopback port in a thread (as
`structgen bench server` does). The clients run in a child process (`http_clients`), as a user's would: in
this process their Python work (and the outputs' checks) would hold the server's GIL, more of it on the side
whose requests finish sooner. Per shape and side, a closed loop as in process: `--concurrency` client workers
each keep one non-streamed chat completion in flight, sending the next (a new prompt and seed) as soon as one
returns: `response_format` json_schema on one side, none and `ignore_eos: true` (vLLM's extra field) on the
other, temperature 1, `max_tokens` (both sides' first waves staggered, as in process). A window opens at a
step boundary `settle_steps` steps after the side's first step (its requests then of every age, as in a
server's steady state: see `structured_shapes`) and closes `--http-steps` steps later; then the workers are
cancelled (their connections close and the server aborts what they had in flight) and the engine drains
before the other side starts. The sides alternate over `--passes` windows each (the first side of a pass
alternates too), so drift and the engine's warm state hit both alike. A warm-up request per side first
compiles the schema.

Why windows and not a fixed set of requests: with one wave of requests per pass the batch empties as they
finish, and a side whose outputs vary in length (the JSON one: `nested` stops after ~60 tokens, give or take
30) spent its tail at a fraction of the batch while the unconstrained side (all `max_tokens` long) ran full
to the end: the ratio measured the tail, and moved by 4-10 points between runs.

Tokens: read off the engine's own counters at the window's two step boundaries, as in process: sampled rows
(`counters.num_generated_tokens`) and jump-forward tokens (`output_processor.num_forced_tokens`). The outputs
whose responses came back inside the window are checked with `jsonschema` after it. Prompts differ between the
sides (a tag in the prompt) so neither side hits the other's prompts in the shared prefix cache.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from structgen.bench.http_clients import ClientProcess, Workload
from structgen.bench.structured_engine import make_engine
from structgen.bench.structured_shape_schemas import SHAPES, prompt_format, validator
from structgen.bench.structured_shapes import SEED, Tally, first_wave_stagger, ratios, settle_steps

# The two sides, in the order of even passes.
SIDES = ("unconstrained", "json")
_CHECK_CLIENTS_S = 0.1  # how often a wait for a step boundary checks that the client process still runs
_DRAIN_TIMEOUT_S = 120.0


def _workload(
    name: str,
    shape: str,
    first_index: int,
    *,
    side: str,
    max_tokens: int,
    concurrency: int = 0,
    settle: bool = True,
) -> Workload:
    template: dict[str, Any] = {"model": name, "max_tokens": max_tokens, "temperature": 1.0}
    if side == "json":
        schema = SHAPES[shape]
        template["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": shape, "schema": schema},
        }
    else:
        template["ignore_eos"] = True  # never ends early: the conservative baseline, as in process
    stagger = first_wave_stagger(constrained=side == "json", concurrency=concurrency, settle=settle)
    return Workload(template, prompt_format(shape, tag=side[0]), first_index, SEED, stagger=stagger)


class _Counters:
    """The served engine's step, sampled-token and forced-token counts, and the time of the step boundary a
    window waits for. A hook on the engine's `step` (in the engine's thread, a comparison a step) takes them
    as the boundary's step ends and wakes this thread, which sleeps meanwhile. It used to poll every 2 ms: a
    thread taking the GIL ~500 times a second slowed the constrained side's steps by ~10% on `tiny` (whose
    forward hands the GIL back and forth at every op while the mask thread, the server and the clients share
    the other core) and the unconstrained side's not at all (BENCHMARKS.md, session 17). A context manager:
    the hook is removed on exit."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._target: int | None = None  # the step count to wake at, set by `boundary`
        self._hit = threading.Event()
        self._at: tuple[float, tuple[int, int, int]] | None = None

    def __enter__(self) -> _Counters:
        llm = self.engine.engine
        step = llm.step

        def step_and_note() -> Any:
            outputs = step()
            target = self._target
            if target is not None and llm.counters.num_steps >= target:
                self._target = None
                self._at = (time.monotonic(), self.read())
                self._hit.set()
            return outputs

        llm.step = step_and_note  # the instance's attribute: the engine's thread looks it up every step
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.engine.step

    def read(self) -> tuple[int, int, int]:
        llm = self.engine.engine
        return (
            llm.counters.num_steps,
            llm.counters.num_generated_tokens,
            llm.output_processor.num_forced_tokens,
        )

    def boundary(self, after: int, clients: ClientProcess) -> tuple[float, tuple[int, int, int]]:
        """The time and counts at the end of the first step that brings the count to `after` or past it (the
        next step, if the engine is there already)."""
        self._hit.clear()
        self._target = after
        while not self._hit.wait(_CHECK_CLIENTS_S):
            clients.raise_if_failed()
        assert self._at is not None
        return self._at

    def drained(self) -> None:
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while self.engine.engine.has_unfinished():
            if time.monotonic() > deadline:
                raise RuntimeError("the server still had requests in flight after its clients left")
            time.sleep(0.01)


def _window(
    clients: ClientProcess,
    counters: _Counters,
    workload: Workload,
    *,
    steps: int,
    opens_after: int,
    tally: Tally,
    check: Any | None,
) -> tuple[int, float]:
    """One side's closed loop for one window of `steps` engine steps, `opens_after` steps after its first; adds to
    `tally`; the next index and the window's sampled tokens/s."""
    first = counters.read()[0]
    clients.run(workload)
    try:
        start_s, start = counters.boundary(first + 1 + opens_after, clients)
        end_s, end = counters.boundary(start[0] + steps, clients)
    finally:
        finished, next_index = clients.stop()
    counters.drained()
    for out in finished:
        if start_s <= out.at <= end_s:
            tally.count(out.text, out.finish_reason, check)
    tally.seconds += end_s - start_s
    tally.steps += end[0] - start[0]
    tally.sampled += end[1] - start[1]
    tally.forced += end[2] - start[2]
    return next_index, round((end[1] - start[1]) / (end_s - start_s), 1)


def _shape(url: str, engine: Any, name: str, shape: str, *, passes: int, **options: Any) -> dict[str, Any]:
    concurrency, max_tokens, steps = options["concurrency"], options["max_tokens"], options["steps"]
    settle = options["settle"]
    tallies = {side: Tally() for side in SIDES}
    checks = {"unconstrained": None, "json": validator(SHAPES[shape])}
    next_index = dict.fromkeys(SIDES, 0)  # a new prompt and seed per request, per side
    window_rates: dict[str, list[float]] = {side: [] for side in SIDES}
    with _Counters(engine) as counters, ClientProcess(url, concurrency=concurrency) as clients:
        for side in SIDES:  # warm-up: the schema compiled, the server's paths exercised once
            clients.once(_workload(name, shape, -1, side=side, max_tokens=8).body(-1))
        for p in range(passes):
            for side in SIDES if p % 2 == 0 else SIDES[::-1]:
                workload = _workload(
                    name,
                    shape,
                    next_index[side],
                    side=side,
                    max_tokens=max_tokens,
                    concurrency=concurrency,
                    settle=settle,
                )
                next_index[side], rate = _window(
                    clients,
                    counters,
                    workload,
                    steps=steps,
                    opens_after=settle_steps(max_tokens, settle=settle),
                    tally=tallies[side],
                    check=checks[side],
                )
                window_rates[side].append(rate)
    result = ratios(tallies["unconstrained"], tallies["json"], report=_side)
    # Sampled tokens/s of each window in order, to read the spread between passes.
    result["unconstrained"]["window_tok_s"] = window_rates["unconstrained"]
    result["constrained"]["window_tok_s"] = window_rates["json"]
    # With both cores in the forward a window of 100 steps is ~1 s on `tiny`, and windows of one side moved by
    # up to a third between passes (session 21): the ratio of the sides' median windows, beside the totals',
    # shows how much one odd window moved the result.
    plain, json_side = (statistics.median(window_rates[side]) for side in SIDES)
    result["unconstrained"]["window_median_tok_s"] = plain
    result["constrained"]["window_median_tok_s"] = json_side
    result["ratio_sampled_window_median"] = round(json_side / plain, 3) if plain > 0 else 0.0
    return result


def print_window_medians(results: dict[str, Any]) -> None:
    """One line per shape: the sides' median window rates and their ratio (next to the table's totals)."""
    print("  sampled tok/s, median window: plain / json = ratio")
    for shape, r in results.items():
        plain, json_side = r["unconstrained"]["window_median_tok_s"], r["constrained"]["window_median_tok_s"]
        print(f"  {shape:15} {plain:9.1f} / {json_side:9.1f} = {r['ratio_sampled_window_median']}")


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
    model: str | None,
    shapes: list[str],
    *,
    steps: int,
    passes: int,
    concurrency: int,
    max_tokens: int,
    settle: bool = True,
) -> dict[str, Any]:
    """{shape: result} measured through the server (see the module's docstring)."""
    from structgen.bench.server import _Uvicorn
    from structgen.engine.async_engine import AsyncEngine
    from structgen.server import build_app

    kv = max(32768, 2 * concurrency * (max_tokens + 64))
    # Built on the step thread, as `structgen serve` builds its engine (`AsyncEngine.from_config`): one built
    # here and stepped there leaves two OpenMP teams in the process, whose workers then sleep between ops
    # instead of spinning; with two threads the unconstrained side's steps took 11.6-14.3 ms instead of the
    # server's 9.3-9.9 on `tiny`, flattering the ratios (BENCHMARKS.md, "(s) Session 21").
    engine = AsyncEngine(
        build=lambda: make_engine(
            model, jump_forward=True, max_num_seqs=max(64, concurrency), kv_cache_tokens=kv
        )
    )
    name = model or "smollm2-135m"
    options = {"concurrency": concurrency, "max_tokens": max_tokens, "steps": steps, "settle": settle}
    try:
        with _Uvicorn(build_app(engine, engine.engine.tokenizer, model_name=name)) as url:
            return {shape: _shape(url, engine, name, shape, passes=passes, **options) for shape in shapes}
    finally:
        engine.shutdown()
