"""LLMEngine behaviour: stop conditions, errors at admission, abort, streaming deltas, grammar waits, metrics."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import EngineFactory, run_all

from structgen.engine.llm_engine import LLMEngine
from structgen.engine.sequence import Sequence, SequenceStatus
from structgen.sampling_params import SamplingParams

_rng = random.Random(1)
PROMPT = [_rng.randrange(1000, 50000) for _ in range(20)]


def varied(**overrides: object) -> SamplingParams:
    """Seeded sampling: the random model's greedy output repeats one token; this gives varied text."""
    fields: dict[str, object] = {
        "temperature": 0.8,
        "top_k": 40,
        "seed": 5,
        "max_tokens": 16,
        "ignore_eos": True,
    }
    return SamplingParams(**(fields | overrides))  # type: ignore[arg-type]


def generate(engine: LLMEngine, params: SamplingParams, prompt: list[int] = PROMPT, request_id: str = "r"):
    engine.add_request(request_id, prompt, params, stream=False)
    return run_all(engine)[request_id].outputs[0]


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="module")
def reference(engine: LLMEngine):
    return generate(engine, varied(), request_id="reference")


def force_eos_after(engine: LLMEngine, num_tokens: int) -> None:
    """A logits processor that makes EOS overwhelmingly likely once `num_tokens` tokens exist."""
    eos = min(engine.eos_token_ids)

    def processor(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens >= num_tokens:
                logits[row, eos] = 1e4

    engine.logits_processor = processor


# -- stop conditions ---------------------------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(reference) -> None:
    assert len(reference.token_ids) == 16
    assert reference.finish_reason == "length" and reference.stop_reason is None
    assert reference.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(engine: LLMEngine, reference, include: bool) -> None:
    text = reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    out = generate(engine, varied(stop=[stop], include_stop_str_in_output=include))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: cut + (len(stop) if include else 0)]
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]


def test_stop_token_id(engine: LLMEngine, reference) -> None:
    stop_id = reference.token_ids[5]
    k = reference.token_ids.index(stop_id)
    out = generate(engine, varied(stop_token_ids=[stop_id]))
    assert out.token_ids == reference.token_ids[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == engine.tokenizer.decode(reference.token_ids[:k])


def test_eos_stops_unless_ignored(make_engine: EngineFactory) -> None:
    engine = make_engine()
    force_eos_after(engine, 3)
    out = generate(engine, varied(ignore_eos=False))
    assert out.token_ids[-1] in engine.eos_token_ids and len(out.token_ids) == 4
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == engine.tokenizer.decode(out.token_ids[:-1])
    ignored = generate(engine, varied(ignore_eos=True, max_tokens=8), request_id="ignored")
    assert len(ignored.token_ids) == 8 and ignored.finish_reason == "length"
    # min_tokens: EOS is banned until 6 tokens exist, then the boosted EOS comes at once.
    late = generate(engine, varied(ignore_eos=False, min_tokens=6), request_id="late")
    assert len(late.token_ids) == 7 and late.token_ids[-1] in engine.eos_token_ids


def test_no_max_tokens_runs_to_the_context_limit(make_engine: EngineFactory) -> None:
    engine = make_engine(max_model_len=26)
    out = generate(engine, varied(max_tokens=None))
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_engine_seed_makes_unseeded_sampling_reproducible(make_engine: EngineFactory) -> None:
    runs = []
    for seed in (123, 123, 124):
        engine = make_engine(seed=seed)
        for i in range(2):
            engine.add_request(str(i), PROMPT[i:], varied(seed=None, max_tokens=6))
        runs.append([out.outputs[0].token_ids for _, out in sorted(run_all(engine).items())])
    assert runs[0] == runs[1] != runs[2]


def test_n_samples_in_one_output(engine: LLMEngine) -> None:
    engine.add_request("n", PROMPT, varied(n=3, max_tokens=5), stream=False)
    out = run_all(engine)["n"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in out.outputs)


def test_logprobs(engine: LLMEngine) -> None:
    out = generate(engine, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id and lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == token_id  # greedy takes the best
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


# -- admission errors ----------------------------------------------------------------------------------------------


def test_requests_that_can_never_fit_are_rejected(make_engine: EngineFactory) -> None:
    engine = make_engine(kv_cache_tokens=64, max_model_len=48)
    with pytest.raises(ValueError, match="exceeds the model context of 48"):
        engine.add_request("a", PROMPT, SamplingParams(max_tokens=40))
    small_cache = make_engine(kv_cache_tokens=32)
    with pytest.raises(ValueError, match="whole KV cache"):
        small_cache.add_request("b", PROMPT, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt has 40 tokens"):
        small_cache.add_request("c", PROMPT * 2, SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("d", [], SamplingParams())
    with pytest.raises(ValueError, match="not in the vocabulary"):
        engine.add_request("e", [1, 2, 10**7], SamplingParams())
    with pytest.raises(ValueError, match="n=9 exceeds max_num_seqs"):
        make_engine(max_num_seqs=8).add_request("f", PROMPT, SamplingParams(n=9))
    engine.add_request("g", PROMPT, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("g", PROMPT, SamplingParams(max_tokens=4))
    assert engine.num_unfinished == 1 and small_cache.num_unfinished == 0


def test_chunked_prefill_off_needs_a_big_enough_budget(make_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128)


# -- abort ---------------------------------------------------------------------------------------------------------


def test_abort_mid_generation_frees_everything(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=2)
    bm = engine.block_manager
    for i in range(3):
        engine.add_request(f"a{i}", [t + i for t in PROMPT], varied(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_running == 2 and engine.stats().num_waiting == 1
    used = bm.num_used_blocks
    engine.abort("a0")
    assert bm.num_used_blocks < used
    assert engine.step()[0].request_id == "a1"  # a2 takes a0's place; a1 keeps going
    engine.abort(["a1", "a2", "unknown"])
    assert not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert engine.step() == []
    assert engine.stats().num_requests_aborted == 3


# -- streaming, waiting for a grammar, prefix cache, metrics -------------------------------------------------------


@pytest.mark.parametrize("stop", [None, ["e"]])
def test_stream_deltas_add_up(engine: LLMEngine, stop: list[str] | None) -> None:
    engine.add_request("s", PROMPT, varied(stop=stop), stream=True)
    deltas, delta_ids, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            delta_ids.extend(out.outputs[0].delta_token_ids)
            last = out
    assert last is not None and last.finished
    assert "".join(deltas) == last.outputs[0].text
    assert delta_ids == last.outputs[0].token_ids
    assert len(deltas) == len(delta_ids)  # one output per step, each with its one new token


def test_waiting_for_grammar_does_not_block_others(engine: LLMEngine) -> None:
    gate = {"open": False}
    engine.add_request("gated", PROMPT, varied(max_tokens=2), ready=lambda: gate["open"])
    engine.add_request("free", PROMPT[::-1], varied(max_tokens=2))
    outputs = [out.request_id for _ in range(3) for out in engine.step()]
    assert "free" in outputs and "gated" not in outputs
    assert engine.stats().num_waiting_for_grammar == 1
    gate["open"] = True
    assert "gated" in run_all(engine)


def test_prefix_cache_hit_gives_the_same_output(make_engine: EngineFactory) -> None:
    engine = make_engine()
    first = generate(engine, varied(), request_id="first")
    engine.add_request("second", PROMPT, varied(), stream=False)
    second = run_all(engine)["second"]
    # One full block and the first 3 tokens of the next: all but the last prompt token, which is recomputed.
    assert second.num_cached_tokens == len(PROMPT) - 1 == 19
    assert second.outputs[0].token_ids == first.token_ids
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 19 and 0 < stats.prefix_cache_hit_rate < 1


def test_a_prompt_sharing_part_of_a_block_reuses_it_and_gets_its_own_output(
    make_engine: EngineFactory,
) -> None:
    # The second prompt shares the first one's first 18 tokens (a block and 2 tokens), then goes its own way.
    other = [*PROMPT[:18], *(_rng.randrange(1000, 50000) for _ in range(7))]
    alone = generate(make_engine(), varied(), prompt=other)
    engine = make_engine()
    generate(engine, varied(), request_id="first")
    engine.add_request("second", other, varied(), stream=False)
    second = run_all(engine)["second"]
    assert second.num_cached_tokens == 18
    assert second.outputs[0].token_ids == alone.token_ids  # the shared block was copied, not written over
    third = generate(engine, varied(), request_id="third")  # the first prompt again: its blocks intact
    assert third.token_ids == generate(make_engine(), varied()).token_ids


def test_metrics(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("m", PROMPT, varied(max_tokens=5), stream=False)
    out = run_all(engine)["m"]
    metrics = out.metrics
    assert metrics is not None and metrics.ttft is not None and metrics.ttft > 0
    assert metrics.tpot is not None and metrics.tpot > 0 and metrics.num_output_tokens == 5
    assert metrics.e2e_latency is not None and metrics.e2e_latency >= metrics.ttft
    stats = engine.stats()
    assert stats.num_generated_tokens == 5 and stats.num_prompt_tokens_computed == len(PROMPT)
    assert stats.num_requests_finished == 1 and stats.num_steps == 5
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert list(engine.counters.finished_requests) == [metrics]
    assert SequenceStatus.FINISHED_LENGTH.finish_reason == "length"
