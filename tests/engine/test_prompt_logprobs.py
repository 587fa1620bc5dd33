"""`SamplingParams.prompt_logprobs`: each prompt token's logprob given the tokens before it, aligned with what
the model predicts after each prefix, whatever the chunking, the prefix cache or preemption."""

from __future__ import annotations

import random

import pytest
from engine_helpers import EngineFactory, run_all

from structgen.engine.llm_engine import LLMEngine
from structgen.engine.prompt_logprobs import prompt_spans
from structgen.engine.sequence import Sequence
from structgen.sampling_params import SamplingParams

_rng = random.Random(7)
PROMPT = [_rng.randrange(1000, 50000) for _ in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def scored(engine: LLMEngine, prompt: list[int], k: int, request_id: str = "p", **fields: object):
    options: dict[str, object] = {
        "temperature": 0.0,
        "max_tokens": 2,
        "ignore_eos": True,
        "prompt_logprobs": k,
    }
    params = SamplingParams(**(options | fields))  # type: ignore[arg-type]
    engine.add_request(request_id, prompt, params, stream=False)
    return run_all(engine)[request_id]


@pytest.fixture(scope="module")
def engine(make_engine: EngineFactory) -> LLMEngine:
    return make_engine()


def test_each_entry_is_what_the_model_predicts_after_the_prefix(engine: LLMEngine) -> None:
    prompt = PROMPT[:12]
    entries = scored(engine, prompt, 5).prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        # The sampled-token logprobs after prompt[:i] list the same distribution's best 5 tokens.
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
        engine.add_request(f"prefix{i}", prompt[:i], params, stream=False)
        step = run_all(engine)[f"prefix{i}"].outputs[0].logprobs[0]
        entry = entries[i]
        assert entry.token_id == prompt[i] and entry.logprob <= 0.0 and entry.rank >= 1
        assert [t for t, _ in entry.top_logprobs] == [t for t, _ in step.top_logprobs]
        for (_, a), (_, b) in zip(entry.top_logprobs, step.top_logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
        best = dict(step.top_logprobs)
        if prompt[i] in best:
            assert entry.logprob == pytest.approx(best[prompt[i]], abs=1e-4)
            assert entry.rank == [t for t, _ in step.top_logprobs].index(prompt[i]) + 1
        else:
            assert entry.rank > 5 and entry.logprob < step.top_logprobs[-1][1] + 1e-6


def test_scores_the_generated_tokens_as_they_were_sampled(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=6, ignore_eos=True, logprobs=0)
    engine.add_request("gen", PROMPT[:10], params, stream=False)
    out = run_all(engine)["gen"].outputs[0]
    entries = scored(engine, PROMPT[:10] + out.token_ids, 0, "rescore").prompt_logprobs
    for sampled, entry in zip(out.logprobs, entries[10:], strict=True):
        assert entry.token_id == sampled.token_id and entry.top_logprobs == []
        assert entry.logprob == pytest.approx(sampled.logprob, abs=1e-4)


def test_chunked_prefill_gives_the_same_entries(make_engine: EngineFactory, engine: LLMEngine) -> None:
    whole = scored(engine, PROMPT, 3).prompt_logprobs
    chunked = scored(make_engine(max_num_batched_tokens=7), PROMPT, 3).prompt_logprobs
    assert len(chunked) == len(whole) == len(PROMPT)
    for a, b in zip(whole[1:], chunked[1:], strict=True):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def assert_same_entries(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for a, b in zip(got[1:], want[1:], strict=True):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert [v for _, v in a.top_logprobs] == pytest.approx([v for _, v in b.top_logprobs], abs=1e-4)


def test_a_scored_prompt_leaves_its_scores_in_the_prefix_cache(make_engine: EngineFactory) -> None:
    engine = make_engine(enable_prefix_caching=True)
    first = scored(engine, PROMPT, 1, "first")
    assert first.num_cached_tokens == 0
    again = scored(engine, PROMPT, 1, "again")
    # 40 tokens: 2 whole blocks kept their scores; the last of their 32 tokens runs again to score token 32.
    assert again.num_cached_tokens == 31
    assert_same_entries(again.prompt_logprobs, first.prompt_logprobs)
    engine.add_request("plain", PROMPT, GREEDY, stream=False)
    plain = run_all(engine)["plain"]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_answers_to_one_context_reuse_its_scores(make_engine: EngineFactory) -> None:
    # lm-evaluation-harness scores one context with each answer: the context is scored once.
    context = PROMPT[:37]
    answers = [PROMPT[37:40] + PROMPT[:9], [7, 8, 9, 10, 11], [12]]
    engine = make_engine(enable_prefix_caching=True)
    reference = make_engine(enable_prefix_caching=False)
    for i, answer in enumerate(answers):
        out = scored(engine, context + answer, 2, f"answer{i}")
        alone = scored(reference, context + answer, 2, f"alone{i}")
        assert_same_entries(out.prompt_logprobs, alone.prompt_logprobs)
        if i:  # the first answer's 49 tokens left 3 whole blocks: the context's 37 tokens are reused but its last
            assert out.num_cached_tokens == 36


def test_answers_sent_together_wait_for_their_context_to_be_scored(make_engine: EngineFactory) -> None:
    context = PROMPT[:37]
    answers = [PROMPT[37:40] + PROMPT[:9], [7, 8, 9, 10, 11], [12]]
    engine = make_engine(enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    for i, answer in enumerate(answers):
        engine.add_request(f"answer{i}", context + answer, params, stream=False)
    outs = run_all(engine)
    reference = make_engine(enable_prefix_caching=False)
    for i, answer in enumerate(answers):
        alone = scored(reference, context + answer, 2, f"alone{i}")
        assert_same_entries(outs[f"answer{i}"].prompt_logprobs, alone.prompt_logprobs)
    # The first answer's prompt scored the context; the others waited a step and read it from the cache.
    assert [outs[f"answer{i}"].num_cached_tokens for i in range(3)] == [0, 36, 36]


def test_a_request_for_more_alternatives_than_cached_computes_them(make_engine: EngineFactory) -> None:
    engine = make_engine(enable_prefix_caching=True)
    reference = make_engine(enable_prefix_caching=False)
    scored(engine, PROMPT, 1, "k1")
    more = scored(engine, PROMPT, 3, "k3")
    assert more.num_cached_tokens == 0  # the cache holds 1 alternative a position
    assert_same_entries(more.prompt_logprobs, scored(reference, PROMPT, 3, "ref3").prompt_logprobs)
    # The blocks now hold 3 alternatives a position: 2 are served from them.
    fewer = scored(engine, PROMPT, 2, "k2")
    assert fewer.num_cached_tokens == 31
    assert_same_entries(fewer.prompt_logprobs, scored(reference, PROMPT, 2, "ref2").prompt_logprobs)


def test_n_samples_share_one_prompt_scoring(engine: LLMEngine) -> None:
    out = scored(engine, PROMPT[:9], 2, n=3, temperature=0.7, seed=1)
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == 9
    assert all(len(e.top_logprobs) == 2 for e in out.prompt_logprobs[1:])


def test_a_one_token_prompt_has_nothing_to_score(engine: LLMEngine) -> None:
    out = scored(engine, PROMPT[:1], 4)
    assert out.prompt_logprobs == [None] and len(out.outputs[0].token_ids) == 2


def test_preemption_does_not_score_twice(make_engine: EngineFactory) -> None:
    # A cache of 6 blocks for three 40-token prompts that each grow by 24: some must be preempted and recompute.
    engine = make_engine(kv_cache_tokens=96, block_size=16, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    for i in range(3):
        engine.add_request(str(i), PROMPT[i:] + PROMPT[:i], params, stream=False)
    outs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    reference = make_engine()
    for i in range(3):
        prompt = PROMPT[i:] + PROMPT[:i]
        alone = scored(reference, prompt, 0, f"alone{i}").prompt_logprobs
        entries = outs[str(i)].prompt_logprobs
        assert [e.token_id for e in entries[1:]] == prompt[1:]
        assert [e.logprob for e in entries[1:]] == pytest.approx([e.logprob for e in alone[1:]], abs=1e-4)


def test_spans_skip_what_is_scored_and_the_last_prompt_position() -> None:
    params = SamplingParams(prompt_logprobs=0)
    seq = Sequence(0, list(range(100, 110)), params=params)
    seq.prompt_logprobs = [None]
    (span,) = prompt_spans([seq], [4])
    assert (span.row, span.first, span.count) == (0, 1, 4)  # positions 0-3 score tokens 1-4
    seq.prompt_logprobs += [object()] * 4
    seq.num_computed_tokens = 4
    other = Sequence(1, [5, 6, 7])  # asks for nothing: its rows only shift the next ones
    (span,) = prompt_spans([other, seq], [3, 6])
    assert (span.row, span.first, span.count) == (3, 5, 5)  # token 9 is the last one: position 9 samples
    # Preempted and recomputing from 0: positions whose tokens are scored already score nothing again.
    seq.num_computed_tokens = 0
    (span,) = prompt_spans([seq], [7])
    assert (span.row, span.first, span.count) == (4, 5, 3)  # positions 4-6 score tokens 5-7
    seq.prompt_logprobs += [object()] * 5
    assert not seq.scores_prompt and prompt_spans([seq], [10]) == []
