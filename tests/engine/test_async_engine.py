"""AsyncEngine: concurrent streams from the background step loop, abort on cancel / close, errors, shutdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from engine_helpers import EngineFactory

from structgen.engine.async_engine import AsyncEngine, EngineDeadError
from structgen.engine.llm_engine import LLMEngine
from structgen.engine.outputs import RequestOutput
from structgen.sampling_params import SamplingParams

PROMPTS = [[1000 + 7 * i + j for j in range(5 + 6 * i)] for i in range(3)]


def params(seed: int, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=40, seed=seed, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def engine(make_engine: EngineFactory) -> Iterator[AsyncEngine]:
    async_engine = AsyncEngine(make_engine())
    yield async_engine
    async_engine.shutdown()


async def collect(engine: AsyncEngine, prompt: list[int], p: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, p)]


async def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the aborted request never left the engine"
        await asyncio.sleep(0.01)


def test_concurrent_streams_match_the_sync_engine(engine: AsyncEngine, make_engine: EngineFactory) -> None:
    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine, p, params(i)) for i, p in enumerate(PROMPTS)))

    streams = asyncio.run(main())
    sync = make_engine()
    for i, prompt in enumerate(PROMPTS):
        sync.add_request(str(i), prompt, params(i), stream=False)
    expected = {}
    while sync.has_unfinished():
        expected.update({o.request_id: o for o in sync.step()})
    for i, outputs in enumerate(streams):
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert "".join(o.outputs[0].delta_text for o in outputs) == final.outputs[0].text
        assert [t for o in outputs for t in o.outputs[0].delta_token_ids] == final.outputs[0].token_ids
        assert final.outputs[0].token_ids == expected[str(i)].outputs[0].token_ids


def test_leaving_the_stream_early_aborts(engine: AsyncEngine) -> None:
    async def main() -> None:
        count = 0
        async for _ in engine.generate(PROMPTS[0], params(0, max_tokens=500)):
            count += 1
            if count == 2:
                break  # asyncio closes the dropped generator (its finally posts the abort)
        await wait_idle(engine.engine)

    asyncio.run(main())
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.engine.stats().num_requests_aborted == 1


def test_cancelling_the_consumer_task_aborts(engine: AsyncEngine) -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[1], params(1, max_tokens=500)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine.engine)

    asyncio.run(main())
    assert engine.engine.stats().num_requests_aborted == 1


def test_explicit_abort_ends_the_stream(engine: AsyncEngine) -> None:
    async def main() -> list[RequestOutput]:
        outputs = []
        async for out in engine.generate(PROMPTS[2], params(2, max_tokens=500), request_id="victim"):
            outputs.append(out)
            if len(outputs) == 1:
                await engine.abort("victim")
        return outputs

    outputs = asyncio.run(main())
    assert 1 <= len(outputs) < 500 and not outputs[-1].finished
    assert not engine.engine.has_unfinished()


def test_bad_request_raises_on_iteration(engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, [], params(0))
        with pytest.raises(ValueError, match="model context"):
            await collect(engine, PROMPTS[0], SamplingParams(max_tokens=10**6))
        # The loop survives bad requests.
        assert (await collect(engine, PROMPTS[0], params(0, max_tokens=2)))[-1].finished

    asyncio.run(main())


def test_request_waiting_for_grammar_runs_once_ready(engine: AsyncEngine) -> None:
    gate = {"open": False}

    async def main() -> tuple[float, float]:
        async def timed(**kwargs: object) -> float:
            async for _ in engine.generate(PROMPTS[0], params(0, max_tokens=3), **kwargs):  # type: ignore[arg-type]
                pass
            return time.monotonic()

        gated = asyncio.create_task(timed(ready=lambda: gate["open"]))
        free_done = await timed()
        gate["open"] = True
        return free_done, await gated

    free_done, gated_done = asyncio.run(main())
    assert gated_done > free_done


def test_shutdown_ends_streams_and_refuses_new_requests(make_engine: EngineFactory) -> None:
    engine = AsyncEngine(make_engine())

    async def main() -> list[RequestOutput]:
        outputs = []
        async for out in engine.generate(PROMPTS[0], params(0, max_tokens=500)):
            outputs.append(out)
            if len(outputs) == 1:
                await asyncio.to_thread(engine.shutdown)
        return outputs

    outputs = asyncio.run(main())
    assert not outputs[-1].finished and not engine.is_running
    assert not engine.engine.has_unfinished()
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(collect(engine, PROMPTS[0], params(0)))


def test_an_engine_built_by_the_async_engine_is_built_on_its_step_thread(make_engine: EngineFactory) -> None:
    import threading

    built_on: list[threading.Thread] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread())
        return make_engine()

    async_engine = AsyncEngine(build=build)
    try:
        assert built_on == [async_engine._thread]  # the thread that steps it: one OpenMP team in the process
        outputs = asyncio.run(collect(async_engine, PROMPTS[0], params(0)))
        assert outputs[-1].finished
    finally:
        async_engine.shutdown()


def test_an_engine_built_elsewhere_is_served_with_a_warning_on_the_cpu(
    make_engine: EngineFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stepping on another thread an engine built here leaves two OpenMP teams: it works, slower, and says so."""
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for build_there in (True, False):
        caplog.clear()
        async_engine = AsyncEngine(build=make_engine) if build_there else AsyncEngine(make_engine())
        try:
            assert asyncio.run(collect(async_engine, PROMPTS[0], params(0)))[-1].finished
        finally:
            async_engine.shutdown()
        warned = [r for r in caplog.records if "AsyncEngine.from_config" in r.getMessage()]
        assert len(warned) == (0 if build_there else 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: no team, nothing to say
    caplog.clear()
    AsyncEngine(make_engine()).shutdown()
    assert not [r for r in caplog.records if "AsyncEngine.from_config" in r.getMessage()]


def test_a_failed_build_raises_on_the_callers_thread() -> None:
    def build() -> LLMEngine:
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build=build)
    with pytest.raises(ValueError, match="an engine or a build function"):
        AsyncEngine()


def test_a_request_without_streaming_yields_its_first_and_finished_outputs(
    engine: AsyncEngine, make_engine: EngineFactory
) -> None:
    async def main() -> list[RequestOutput]:
        return [out async for out in engine.generate(PROMPTS[1], params(3, max_tokens=8), stream=False)]

    outputs = asyncio.run(main())
    assert len(outputs) == 2 and not outputs[0].finished and outputs[1].finished
    streamed = asyncio.run(collect(engine, PROMPTS[1], params(3, max_tokens=8)))
    assert len(streamed) == 8
    assert outputs[0].outputs[0].token_ids == streamed[0].outputs[0].token_ids
    assert outputs[1].outputs[0].token_ids == streamed[-1].outputs[0].token_ids
    assert outputs[1].outputs[0].text == streamed[-1].outputs[0].text


def test_a_steps_outputs_reach_the_event_loop_in_one_call(engine: AsyncEngine) -> None:
    # Each call_soon_threadsafe wakes the loop (and hands it the GIL): one per step, not one per stream.
    from structgen.engine.output_streams import deliver

    llm = engine.engine
    step, step_sizes = llm.step, []

    def counted_step() -> list[RequestOutput]:
        outputs = step()
        step_sizes.append(len(outputs))
        return outputs

    llm.step = counted_step
    deliveries: list[int] = []

    async def main() -> list[list[RequestOutput]]:
        loop = asyncio.get_running_loop()
        call = loop.call_soon_threadsafe

        def counted_call(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
            if callback is deliver:
                deliveries.append(len(args[0]))
            return call(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted_call  # type: ignore[method-assign]
        return await asyncio.gather(*(collect(engine, p, params(i)) for i, p in enumerate(PROMPTS)))

    try:
        streams = asyncio.run(main())
    finally:
        del llm.step
    assert [len(outputs) for outputs in streams] == [6, 6, 6]  # every output arrived, in order (above)
    assert all(outputs[-1].finished for outputs in streams)
    assert sum(deliveries) == 18 and len(deliveries) == sum(1 for n in step_sizes if n)
    assert max(deliveries) == 3  # the three streams' outputs of one step together


def test_a_request_whose_event_loop_closed_is_aborted_and_the_engine_goes_on(engine: AsyncEngine) -> None:
    # The loop ends while its request still runs (its iterator never finished nor closed): the step thread's next
    # delivery to it fails. Before, that RuntimeError ended the step loop and every later request got
    # EngineDeadError; now the orphaned request is aborted and the others are served.
    loop = asyncio.new_event_loop()
    stream = engine.generate(PROMPTS[0], params(1, max_tokens=400))
    loop.run_until_complete(stream.__anext__())
    loop.close()
    outputs = asyncio.run(asyncio.wait_for(collect(engine, PROMPTS[1], params(2)), timeout=60))
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6
    asyncio.run(wait_idle(engine.engine))
    assert engine.engine.counters.num_requests_aborted == 1
