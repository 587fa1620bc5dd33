"""BFCL questions with their real function definitions, `tool_choice="required"`, through the engine on
SmolLM2-135M: every finished output is a valid call (allowed name, arguments valid against the schema).
The whole set runs in `benchmarks/tools.py`; this is a fixed stratified sample of 12."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from live_server import wait_idle
from shared_data import BFCL

from structgen.bench.tools import CATEGORIES, Score, build_requests, load_questions
from structgen.engine.async_engine import AsyncEngine
from structgen.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


async def _generate(engine: AsyncEngine, prompts: list[Any], params: list[SamplingParams]) -> list[Any]:
    async def one(i: int) -> Any:
        final = None
        async for output in engine.generate(prompts[i], params[i], request_id=f"bfcl-test-{i}"):
            final = output
        return final

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def test_sampled_bfcl_questions_get_valid_calls(smollm2_engine: AsyncEngine) -> None:
    questions = load_questions(BFCL, per_category=3)
    assert len(questions) == 12 and {q.category for q in questions} == set(CATEGORIES)
    tokenizer = smollm2_engine.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=96)
    requests, refused = build_requests(questions, tokenizer, params, constrained=True)
    assert refused == 0
    results = asyncio.run(
        _generate(smollm2_engine, [r.prompt for r in requests], [r.params for r in requests])
    )
    wait_idle(smollm2_engine)
    score = Score()
    for request, result in zip(requests, results, strict=True):
        output = result.outputs[0]
        parsed = request.plan.parse(output.text)
        score.add(parsed, output)
        if output.finish_reason != "length":
            names = {t["function"]["name"] for t in request.question.tools}
            assert parsed.valid and parsed.calls, (request.question.id, output.text)
            assert {c.name for c in parsed.calls} <= names
            if not request.question.parallel:
                assert len(parsed.calls) == 1
    assert score.finished >= 5, score.row()  # the one-call answers fit in 96 tokens
    assert score.valid == score.finished
