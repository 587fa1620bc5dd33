"""One `tiny` engine sharded over two gloo ranks on CPU, against the same model unsharded."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from tp_helpers import PROMPTS, greedy_tokens

from structgen.config import CacheConfig, EngineConfig
from structgen.distributed import TensorParallelError
from structgen.engine.llm_engine import LLMEngine
from structgen.sampling_params import SamplingParams
from structgen.structured import StructuredOutputsParams

KV_CACHE_TOKENS = 1024
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def _config(tp_size: int) -> EngineConfig:
    return EngineConfig(
        model="tiny",
        device="cpu",
        dtype="float32",  # sharded partial sums must match the unsharded ones to fp32 accuracy
        tensor_parallel_size=tp_size,
        cache=CacheConfig(kv_cache_tokens=KV_CACHE_TOKENS),
    )


@pytest.fixture(scope="module")
def tp1() -> LLMEngine:
    return LLMEngine(_config(1))


@pytest.fixture(scope="module")
def tp2() -> Iterator[LLMEngine]:
    engine = LLMEngine(_config(2))
    yield engine
    engine.shutdown()


def test_greedy_tokens_match_the_unsharded_model(tp1: LLMEngine, tp2: LLMEngine) -> None:
    expected = greedy_tokens(tp1)
    assert greedy_tokens(tp2) == expected
    # Prefix-cache hits and chunked continuations go through the same broadcast: run the batch again.
    assert greedy_tokens(tp2) == expected


def test_each_rank_holds_half_the_heads_and_its_own_kv_cache(tp2: LLMEngine) -> None:
    attention = tp2.model.model.layers[0].self_attn  # type: ignore[union-attr]
    assert (attention.num_heads, attention.num_kv_heads) == (4, 2)  # tiny: 8 heads, 4 KV heads
    key_cache, _ = tp2.runner.kv_caches[0]
    assert key_cache.shape[2] == 2
    assert tp2.block_manager.num_blocks == KV_CACHE_TOKENS // tp2.config.cache.block_size
    vocab = tp2.model.config.vocab_size  # type: ignore[union-attr]
    assert tp2.model.lm_head.weight.shape[0] == vocab // 2  # type: ignore[union-attr]


def test_a_json_schema_request_validates_under_tp2(tp2: LLMEngine) -> None:
    params = SamplingParams(
        max_tokens=64, temperature=0.0, structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))
    )
    tp2.add_request("structured", "Describe the sky as JSON.", params)
    out = None
    while tp2.has_unfinished():
        for o in tp2.step():
            out = o
    assert out is not None and out.finished
    completion = out.outputs[0]
    jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert completion.structured is not None and completion.structured.valid


def test_sampling_with_a_seed_matches_the_unsharded_model(tp1: LLMEngine, tp2: LLMEngine) -> None:
    # Rank 0 alone samples, from gathered full-vocabulary logits: seeded sampling is unchanged by sharding.
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)

    def run(engine: LLMEngine) -> list[int]:
        engine.add_request("seeded", {"prompt_token_ids": PROMPTS[0]}, params)
        while engine.has_unfinished():
            for o in engine.step():
                tokens = list(o.outputs[0].token_ids)
        return tokens

    assert run(tp2) == run(tp1)


def test_a_second_tp_engine_in_the_same_process_is_refused(tp2: LLMEngine) -> None:
    with pytest.raises(TensorParallelError, match="one tensor-parallel engine per process"):
        LLMEngine(_config(2))


def test_prompt_logprobs_are_refused_under_tp2_and_the_engine_goes_on(tp1: LLMEngine, tp2: LLMEngine) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with tensor_parallel_size > 1"):
        tp2.add_request("scored", PROMPTS[0], SamplingParams(prompt_logprobs=1))
    assert not tp2.has_unfinished()
    assert greedy_tokens(tp2) == greedy_tokens(tp1)
