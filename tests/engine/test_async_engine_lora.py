"""AsyncEngine and LoRA adapters on `tiny`: adapters given at start and added at run time (files read off the step
thread, registered on it), requests naming them by name alone answer as the offline engine does, removal lets a
running request finish and refuses new ones, and every refusal is a `LoRAError` with its status."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from structgen.config import CacheConfig, EngineConfig, LoRAConfig
from structgen.engine.async_engine import AsyncEngine
from structgen.engine.llm_engine import LLMEngine
from structgen.lora import LoRAError, LoRARequest
from structgen.sampling_params import SamplingParams

PROMPT = "Once upon a time"


def config(*, lora: LoRAConfig | None = None) -> EngineConfig:
    # fp32 and a model of its own: an engine with LoRA wraps its model's projections.
    return EngineConfig(
        model="tiny", device="cpu", dtype="float32", cache=CacheConfig(kv_cache_tokens=1024), lora=lora
    )


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(tiny_lora_adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """The offline engine's greedy tokens for PROMPT: the base model (None) and each adapter by name."""
    engine = LLMEngine(config(lora=LoRAConfig()))
    for i, name in enumerate([None, *tiny_lora_adapters]):
        lora = LoRARequest(name, i, str(tiny_lora_adapters[name])) if name else None
        engine.add_request(str(name), PROMPT, greedy(40), lora_request=lora)
    tokens: dict[str | None, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[None if out.request_id == "None" else out.request_id] = out.outputs[0].token_ids
    engine.shutdown()
    return tokens


@pytest.fixture(scope="module")
def engine(tiny_lora_adapters: dict[str, Path]) -> Iterator[AsyncEngine]:
    """Serves "sql" from the start; "poet" is the tests' to add and remove."""
    sql = LoRARequest("sql", 1, str(tiny_lora_adapters["sql"]))
    async_engine = AsyncEngine.from_config(config(lora=LoRAConfig(max_loras=2)), lora_modules=[sql])
    yield async_engine
    async_engine.shutdown()


async def tokens_of(engine: AsyncEngine, lora: LoRARequest | None, max_tokens: int = 6) -> list[int]:
    outputs = [o async for o in engine.generate(PROMPT, greedy(max_tokens), lora_request=lora)]
    return outputs[-1].outputs[0].token_ids


def test_adapters_by_name_generate_as_the_offline_engine(
    engine: AsyncEngine, offline: dict[str | None, list[int]], tiny_lora_adapters: dict[str, Path]
) -> None:
    assert [s.name for s in engine.list_loras()] == ["sql"]
    assert offline["sql"] != offline[None] and offline["poet"] != offline[None]

    async def main() -> None:
        added = await engine.add_lora(LoRARequest("poet", 2, str(tiny_lora_adapters["poet"])))
        assert added.name == "poet" and engine.get_lora("poet") is added
        # By name alone (no path), as the server sends them; base and adapter rows share steps.
        got = await asyncio.gather(
            tokens_of(engine, None),
            tokens_of(engine, LoRARequest("sql")),
            tokens_of(engine, LoRARequest("poet")),
        )
        assert got == [offline[None][:6], offline["sql"][:6], offline["poet"][:6]]
        await engine.remove_lora("poet")

    asyncio.run(main())
    assert [s.name for s in engine.list_loras()] == ["sql"]


def test_removing_an_adapter_lets_its_running_request_finish(
    engine: AsyncEngine, offline: dict[str | None, list[int]], tiny_lora_adapters: dict[str, Path]
) -> None:
    async def main() -> None:
        await engine.add_lora(LoRARequest("poet", 2, str(tiny_lora_adapters["poet"])))
        # The request is added, then held (`ready`) until the adapter is gone: it surely runs after the removal.
        go = asyncio.Event()
        stream = engine.generate(PROMPT, greedy(40), lora_request=LoRARequest("poet"), ready=go.is_set)
        first = asyncio.ensure_future(anext(stream))
        while not engine.engine.has_unfinished():
            await asyncio.sleep(0.005)
        removed = await engine.remove_lora("poet")
        assert removed.removed and engine.get_lora("poet") is None
        go.set()
        outputs = [await first, *[o async for o in stream]]
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == offline["poet"]
        with pytest.raises(LoRAError, match="no LoRA adapter named 'poet'") as refused:
            await tokens_of(engine, LoRARequest("poet"))
        assert refused.value.status == 404

    asyncio.run(main())


def test_add_and_remove_refusals(
    engine: AsyncEngine, tiny_lora_adapters: dict[str, Path], tmp_path: Path
) -> None:
    async def main() -> None:
        with pytest.raises(LoRAError, match="no LoRA adapter directory") as missing:
            await engine.add_lora(LoRARequest("gone", 3, str(tmp_path / "gone")))
        assert missing.value.status == 404
        with pytest.raises(LoRAError, match="already loaded") as taken:
            await engine.add_lora(LoRARequest("sql", 3, str(tiny_lora_adapters["poet"])))
        assert taken.value.status == 400
        again = await engine.add_lora(LoRARequest("sql", 3, str(tiny_lora_adapters["sql"])))
        assert again is engine.get_lora("sql")  # the same name and path: a no-op
        with pytest.raises(LoRAError) as unknown:
            await engine.remove_lora("gone")
        assert unknown.value.status == 404

    asyncio.run(main())
    assert [s.name for s in engine.list_loras()] == ["sql"]


def test_an_engine_without_lora_refuses_adapters(tiny_lora_adapters: dict[str, Path]) -> None:
    async_engine = AsyncEngine(LLMEngine(config()))
    try:
        assert not async_engine.lora_enabled and async_engine.list_loras() == []

        async def main() -> None:
            with pytest.raises(LoRAError, match="not enabled") as off:
                await async_engine.add_lora(LoRARequest("sql", 1, str(tiny_lora_adapters["sql"])))
            assert off.value.status == 400
            with pytest.raises(LoRAError, match="not enabled"):
                await async_engine.remove_lora("sql")

        asyncio.run(main())
    finally:
        async_engine.shutdown()


def test_a_bad_start_adapter_fails_the_build_naming_it(tmp_path: Path) -> None:
    bad = LoRARequest("bad", 1, str(tmp_path / "missing"))
    with pytest.raises(LoRAError, match=r"^LoRA adapter 'bad': no LoRA adapter directory") as error:
        AsyncEngine.from_config(config(lora=LoRAConfig()), lora_modules=[bad])
    assert error.value.status == 404
