"""Fault isolation: an exception inside one request's grammar (accept, mask fill, token check, jump-forward) or its
detokenization fails that request alone (finish reason "error", its KV blocks freed) while the others decode
the tokens they would have decoded anyway; a crash of the step loop marks the `AsyncEngine` dead, fails every
waiting client promptly with `EngineDeadError`, and `/health` answers 503."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from engine_helpers import EngineFactory, run_all

from structgen.engine.async_engine import AsyncEngine, EngineDeadError
from structgen.engine.llm_engine import LLMEngine
from structgen.engine.output_processor import OutputProcessor
from structgen.sampling_params import SamplingParams
from structgen.structured import StructuredOutputsParams
from structgen.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceGrammar
from structgen.structured.request import StructuredRequest

VICTIM_REGEX = "[a-z]{1,40}"
MAX_TOKENS = 8
REQUESTS = {
    # Two constrained neighbours, one plain one, and the victim (constrained or plain by fault kind).
    "regex": ([1000 + i for i in range(6)], "[0-9a-f ]{1,40}"),
    "choice": ([2000 + i for i in range(9)], None),
    "plain": ([3000 + i for i in range(4)], None),
}
FAULTS = ("accept", "fill_bitmask", "token_check", "jump_forward", "detokenize")


def make_params(structured: StructuredOutputsParams | None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, structured_outputs=structured
    )


def add_all(engine: LLMEngine, *, victim_structured: bool) -> None:
    engine.add_request(
        "regex", REQUESTS["regex"][0], make_params(StructuredOutputsParams(regex="[0-9a-f ]{1,40}"))
    )
    engine.add_request(
        "choice", REQUESTS["choice"][0], make_params(StructuredOutputsParams(choice=["alpha", "beta gamma"]))
    )
    engine.add_request("plain", REQUESTS["plain"][0], make_params(None))
    victim = StructuredOutputsParams(regex=VICTIM_REGEX) if victim_structured else None
    engine.add_request("victim", [4000 + i for i in range(5)], make_params(victim))


@pytest.fixture(scope="module")
def baseline(make_engine: EngineFactory) -> dict[bool, dict[str, list[int]]]:
    """Token ids of each request without faults, with the victim constrained or not."""
    out = {}
    for structured in (True, False):
        engine = make_engine()
        add_all(engine, victim_structured=structured)
        out[structured] = {rid: o.outputs[0].token_ids for rid, o in run_all(engine).items()}
    return out


class _Boom(RuntimeError):
    pass


def _inject(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Make the victim's grammar (its regex is VICTIM_REGEX) or detokenizer raise on its second use."""
    victims: set[int] = set()
    calls = {"n": 0}

    def second_call_fails() -> None:
        calls["n"] += 1
        if calls["n"] >= 2:
            raise _Boom(f"injected {fault} fault")

    original_start = StructuredRequest.start

    def start(self: StructuredRequest) -> Any:
        grammar = original_start(self)
        if self.spec.text == VICTIM_REGEX:
            victims.add(id(grammar))
        return grammar

    monkeypatch.setattr(StructuredRequest, "start", start)

    def wrap(cls: type, name: str, is_victim: Callable[..., bool]) -> None:
        original = getattr(cls, name)

        def patched(self: Any, *args: Any) -> Any:
            if is_victim(self, *args):
                second_call_fails()
            return original(self, *args)

        monkeypatch.setattr(cls, name, patched)

    own = lambda self, *_: id(self) in victims  # noqa: E731
    if fault in ("accept", "jump_forward"):
        method = {"accept": "accept_tokens", "jump_forward": "find_jump_forward"}
        wrap(LLGuidanceGrammar, method[fault], own)
    elif fault == "token_check":
        # The sampler's check of a lazy pick (which takes an allowed one at once), and of EOS.
        wrap(StructuredRequest, "take_checked", lambda self, *_: id(self.grammar) in victims)
        wrap(LLGuidanceGrammar, "validate_tokens", own)
    elif fault == "fill_bitmask":
        # The batched native call fails as a whole; the row-by-row retry finds the victim.
        wrap(LLGuidanceGrammar, "fill_bitmask", own)
        wrap(
            LLGuidanceBackend,
            "fill_bitmask_batch",
            lambda _, items, *__: any(id(g) in victims for g, _ in items),
        )
    else:
        original_start_seq = OutputProcessor.start

        def start_seq(self: OutputProcessor, seq: Any) -> None:
            original_start_seq(self, seq)
            if seq.request_id == "victim":
                seq.detokenizer = _FailingDetokenizer(seq.detokenizer, second_call_fails)

        monkeypatch.setattr(OutputProcessor, "start", start_seq)


class _FailingDetokenizer:
    def __init__(self, inner: Any, fail: Callable[[], None]) -> None:
        self.inner = inner
        self.fail = fail

    def push(self, ids: Any) -> str:
        self.fail()
        return self.inner.push(ids)

    def flush(self) -> str:
        return self.inner.flush()


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_fails_only_its_request(
    fault: str,
    make_engine: EngineFactory,
    baseline: dict[bool, dict[str, list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    structured_victim = fault != "detokenize"
    engine = make_engine()
    _inject(monkeypatch, fault)
    add_all(engine, victim_structured=structured_victim)
    finals = run_all(engine)

    victim = finals["victim"].outputs[0]
    assert victim.finish_reason == "error"
    assert victim.error and "injected" in victim.error
    assert len(victim.token_ids) < MAX_TOKENS
    expected = baseline[structured_victim]
    for rid in ("regex", "choice", "plain"):
        out = finals[rid].outputs[0]
        assert out.finish_reason != "error", out.error
        assert out.token_ids == expected[rid], rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()


# -- the step loop crashes ------------------------------------------------------------------------------


@pytest.fixture
def crashing(make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[AsyncEngine]:
    """An AsyncEngine whose third step raises."""
    engine = make_engine()
    original = engine.step
    steps = {"n": 0}

    def step() -> list[Any]:
        steps["n"] += 1
        if steps["n"] == 3:
            raise _Boom("injected step failure")
        return original()

    monkeypatch.setattr(engine, "step", step)
    async_engine = AsyncEngine(engine)
    yield async_engine
    async_engine.shutdown()


def test_step_loop_crash_fails_every_client(crashing: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def client(i: int) -> BaseException | None:
        try:
            async for _ in crashing.generate([500 + i, 501, 502], params):
                pass
        except EngineDeadError as error:
            return error
        return None

    async def main() -> list[BaseException | None]:
        return await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(6))), timeout=30)

    errors = asyncio.run(main())
    assert all(isinstance(e, EngineDeadError) for e in errors)
    assert isinstance(errors[0].__cause__, _Boom)
    assert not crashing.is_running

    async def late() -> None:
        async for _ in crashing.generate([1, 2, 3], params):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(late(), timeout=5))


def test_health_is_503_after_a_crash(crashing: AsyncEngine) -> None:
    from structgen.server import build_app

    app = build_app(crashing, crashing.engine.tokenizer, model_name="tiny")

    async def main() -> tuple[int, int, dict[str, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            before = (await http.get("/health")).status_code
            try:
                async for _ in crashing.generate([7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True)):
                    pass
            except EngineDeadError:
                pass
            after = await http.get("/health")
            return before, after.status_code, after.json()

    before, after, body = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert before == 200
    assert after == 503
    assert body["error"]["message"]
