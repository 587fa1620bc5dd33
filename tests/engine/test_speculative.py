"""N-gram speculative decoding: greedy outputs token for token those without it (free text, under grammars, with
reasoning, chunked by the token budget, preempted, read from the prefix cache), every block returned, and the
proposer on its own."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from engine_helpers import EngineFactory, run_all

from structgen.config import EngineConfig, SpeculativeConfig
from structgen.engine.llm_engine import LLMEngine
from structgen.engine.ngram import propose_ngram
from structgen.sampling_params import SamplingParams
from structgen.structured.spec import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "max_batch_size": 4}
RECORDS = "Record: name Alice Johnson, city Springfield, id 4412. Record: name Bob Stone, city Shelbyville. "
# Engine settings each speculative method is run under (also test_speculative_draft.py).
SETTINGS = [
    {},
    {"max_num_batched_tokens": 8},  # a step's budget cuts some proposals short (taken back)
    {"kv_cache_tokens": 128},  # preemption
    {"enable_prefix_caching": False},
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "id": {"type": "integer"},
    },
    "required": ["name", "city", "id"],
    "additionalProperties": False,
}


def _requests() -> list[tuple[str, SamplingParams]]:
    greedy = {"temperature": 0.0, "max_tokens": 48}
    schema = StructuredOutputsParams(json=SCHEMA)
    return [
        (RECORDS * 3 + "Record: name Alice", SamplingParams(**greedy)),
        (RECORDS * 2, SamplingParams(**greedy, structured_outputs=schema)),
        ("Say something: ", SamplingParams(**greedy, stop=["\n\n"])),
        (RECORDS + "Again: " + RECORDS, SamplingParams(**greedy, structured_outputs=schema, n=2)),
        # Picks through the sampler: penalties read the output so far, logprobs come with each pick.
        (RECORDS * 2, SamplingParams(**greedy, repetition_penalty=1.2, logprobs=2)),
    ]


def _run(engine: LLMEngine, *, alone: bool = False) -> list[list[list[int]]]:
    outputs: dict[str, Any] = {}
    for i, (prompt, params) in enumerate(_requests()):
        engine.add_request(f"r{i}", prompt, params)
        if alone:
            outputs.update(run_all(engine))
    outputs.update(run_all(engine))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [[o.token_ids for o in outputs[f"r{i}"].outputs] for i in range(len(_requests()))]


@pytest.fixture(scope="module")
def without(make_engine: EngineFactory) -> list[list[list[int]]]:
    return _run(make_engine())


def test_the_proposer_continues_the_latest_earlier_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], k=3, max_n=3) == [4, 5, 1]
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], k=2, max_n=2) == [7, 1]  # the latest occurrence
    assert propose_ngram([5, 6, 7], k=2, max_n=3) == []
    assert propose_ngram([1, 2, 3, 1, 2], k=5, max_n=2) == [3, 1, 2]  # stops at the end of the sequence
    # Ids whose 4-byte words overlap a match at an unaligned offset are not matches.
    assert propose_ngram([256, 1, 0, 256], k=1, max_n=1) == [1]
    assert propose_ngram([1, 2, 3, 9, 2, 3], k=1, max_n=2, min_n=2) == [9]
    assert propose_ngram([1, 2, 3, 9, 8, 3], k=1, max_n=2, min_n=2) == []


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_outputs_equal_those_without_speculation(
    make_engine: EngineFactory, without: list[list[list[int]]], setting: dict[str, Any]
) -> None:
    engine = make_engine(speculative_config=SPEC, **setting)
    assert _run(engine) == without
    stats = engine.stats()
    assert stats.num_spec_proposed_tokens > 0
    assert 0 < stats.num_spec_accepted_tokens <= stats.num_spec_proposed_tokens
    if "kv_cache_tokens" in setting:
        assert stats.num_preemptions > 0


def test_alone_and_after_a_prefix_cache_hit(
    make_engine: EngineFactory, without: list[list[list[int]]]
) -> None:
    engine = make_engine(speculative_config={**SPEC, "max_batch_size": 1})
    assert _run(engine, alone=True) == without
    assert _run(engine, alone=True) == without  # the prompts now come from the prefix cache
    assert engine.stats().prefix_cache_hit_tokens > 0


def test_structured_outputs_stay_valid_and_count_as_sampled(make_engine: EngineFactory) -> None:
    engine = make_engine(speculative_config=SPEC)
    params = SamplingParams(
        temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    engine.add_request("r", RECORDS * 4, params)
    output = run_all(engine)["r"].outputs[0]
    assert output.finish_reason == "stop" and output.structured.valid
    assert set(json.loads(output.text)) == {"name", "city", "id"}
    stats = engine.stats()
    forced = output.structured.forced_tokens
    assert stats.num_generated_tokens == len(output.token_ids) - forced


def test_a_grammar_that_rejects_every_proposal_still_progresses(make_engine: EngineFactory) -> None:
    engine = make_engine(speculative_config=SPEC)
    # The prompt repeats tokens a digits-only grammar never takes: every proposal is cut to nothing.
    params = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{20}")
    )
    engine.add_request("r", "abc abc abc abc abc abc", params)
    output = run_all(engine)["r"].outputs[0]
    assert len(output.text) == 20 and output.text.isdigit()


def _letters(make_engine: EngineFactory, spec: dict[str, Any] | None, count: int) -> tuple[Counter[str], Any]:
    engine = make_engine(speculative_config=spec, max_num_seqs=64)
    grammar = StructuredOutputsParams(regex=r"( a| b){6}")
    for seed in range(count):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, structured_outputs=grammar)
        engine.add_request(f"r{seed}", " a b" * 12, params)
    outputs = run_all(engine)
    return Counter(out.outputs[0].text.replace(" ", "")[:3] for out in outputs.values()), engine.stats()


def test_sampled_outputs_keep_their_distribution(make_engine: EngineFactory) -> None:
    """A sampled request draws each token from its own distribution and keeps a proposal only when the draw
    equals it: for a proposal that is one token for sure, that is rejection sampling, so what comes out is
    distributed as without speculation (seeded outputs differ: the draws come in another order)."""
    count = 300
    plain, _ = _letters(make_engine, None, count)
    spec, stats = _letters(make_engine, {**SPEC, "max_batch_size": 64}, count)
    assert stats.num_spec_accepted_tokens > count  # speculation did most of the work
    # Two-sample chi-square over the first three letters (8 outcomes, 7 degrees of freedom): 24.32 is the
    # 0.1% critical value. (The seeds are fixed, so the statistic is the same on every run.)
    statistic = 0.0
    for outcome in set(plain) | set(spec):
        a, b = plain[outcome], spec[outcome]
        statistic += (a - b) ** 2 / (a + b)
    assert statistic < 24.32, (statistic, plain, spec)
    assert len(plain) > 4  # the test model does not favour one outcome so much that the test says nothing


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "medusa"}, "not supported"),
        ({"num_speculative_tokens": 16}, "num_speculative_tokens must be in 1..15"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"bogus": 1}, "unknown speculative config keys"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_configs_are_refused(config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)
    assert EngineConfig(speculative_config='{"method": "ngram"}').speculative_config == SpeculativeConfig()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config=SPEC, tensor_parallel_size=2)


ITEMS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {"key": {"type": "string", "maxLength": 3}, "flag": {"type": "boolean"}},
                "required": ["key", "flag"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("budget", [2048, 6])
def test_proposals_after_a_forced_run_ride_with_it(make_engine: EngineFactory, budget: int) -> None:
    """Each item's forced `},{"key":"` waits for its KV when the next proposals come: both run in one step (or,
    with a step budget too small for them, the proposals are taken back)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=150, structured_outputs=StructuredOutputsParams(json=ITEMS)
    )
    outputs = []
    for spec in (None, SPEC):
        engine = make_engine(speculative_config=spec, max_num_batched_tokens=budget)
        engine.add_request("r", "List: " * 5, params)
        outputs.append(run_all(engine)["r"].outputs[0].token_ids)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outputs[0] == outputs[1]
    assert engine.stats().num_spec_accepted_tokens > 0
