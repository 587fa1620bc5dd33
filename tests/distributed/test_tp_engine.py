"""One `tiny` engine sharded over two gloo ranks on CPU, against the same model unsharded."""

from __future__ import annotations

import json
import time
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
        if tp2.last_step_num_tokens == 0:
            # Nothing ran: the grammar is compiling. A loop that steps again at once starves the compile thread
            # of the GIL (on two cores, with the workers waiting in their broadcast, past its 30 s limit).
            time.sleep(0.005)
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


def test_prompt_logprobs_match_the_unsharded_model(tp1: LLMEngine, tp2: LLMEngine) -> None:
    # Workers take part in each 256-row logits product of the prompt: a 600-token prompt needs three of them,
    # and the same step samples the other request's token (the sampling rows' product comes after).
    prompt = (PROMPTS[2] * 100)[:600]
    scored = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def run(engine: LLMEngine) -> tuple[list[float], list[int], list[int]]:
        engine.add_request("scored", {"prompt_token_ids": prompt}, scored, stream=False)
        engine.add_request("plain", {"prompt_token_ids": PROMPTS[1]}, plain, stream=False)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o
        entries = outs["scored"].prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        tokens = list(outs["scored"].outputs[0].token_ids) + list(outs["plain"].outputs[0].token_ids)
        return [e.logprob for e in entries[1:]], [e.top_logprobs[0][0] for e in entries[1:]], tokens

    sharded, unsharded = run(tp2), run(tp1)
    assert sharded[1:] == unsharded[1:]
    assert sharded[0] == pytest.approx(unsharded[0], abs=1e-4)
    assert greedy_tokens(tp2) == greedy_tokens(tp1)  # the group goes on in step
