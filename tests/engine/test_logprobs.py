"""`logprobs_mode`: raw logprobs are the model's distribution under the mask; processed ones are the distribution
each token was drawn from (penalties, temperature, top-k / top-p / min-p, the mask), checked against the
reference sampler and against the draws themselves; the *_logits modes skip the normalizing; prompt logprobs
follow the logits / logprobs half; a bad mode is refused."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from sampling_reference import NEG_INF, reference_penalties, reference_probs
from test_sampler import make_row, random_logits

from structgen.config import LOGPROBS_MODES, EngineConfig
from structgen.engine.llm import LLM
from structgen.engine.sampler import Sampler
from structgen.engine.token_mask import TokenMask
from structgen.sampling_params import SamplingParams

SAMPLED = [
    SamplingParams(temperature=0.7, logprobs=20),
    SamplingParams(top_k=4, logprobs=20),
    SamplingParams(temperature=1.3, top_p=0.8, logprobs=20),
    SamplingParams(min_p=0.2, logprobs=20),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05, logprobs=20),
]


def _finite(pairs: list[tuple[int, float]]) -> dict[int, float]:
    return {t: v for t, v in pairs if v != NEG_INF}


@pytest.mark.parametrize(
    "params", SAMPLED, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_processed_logprobs_are_the_distribution_drawn_from(params: SamplingParams) -> None:
    vocab = 40
    logits = random_logits(3, vocab, seed=21)
    rows = [make_row(params) for _ in range(3)]
    out = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), rows)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i in range(3):
        probs = reference_probs(logits[i].tolist(), params)
        kept = {t: math.log(p) for t, p in enumerate(probs) if p > 0}
        assert out.logprobs[i] == pytest.approx(kept[out.token_ids[i]], abs=1e-5)
        top = dict(out.top_logprobs[i])
        # every token the draw could reach is listed (at most 20 here), none it could not
        assert set(top) == set(sorted(kept, key=kept.__getitem__, reverse=True)[:20])
        for token, value in top.items():
            assert value == pytest.approx(kept[token], abs=1e-5)
        if len(kept) <= 20:
            assert sum(math.exp(v) for v in top.values()) == pytest.approx(1.0, abs=1e-5)


def test_processed_logprobs_match_the_draws() -> None:
    """Drawn 4,000 times, each token comes out as often as exp(its processed logprob) says."""
    vocab, draws = 12, 4000
    logits = random_logits(1, vocab, seed=22).expand(draws, vocab).contiguous()
    params = SamplingParams(temperature=0.8, top_p=0.85, min_p=0.03, logprobs=0)
    rows = [make_row(params) for _ in range(draws)]  # unseeded: drawn from the sampler's one generator
    sampler = Sampler(generator=torch.Generator().manual_seed(7), logprobs_mode="processed_logprobs")
    out = sampler(logits, rows)
    assert out.logprobs is not None
    counts = Counter(out.token_ids)
    expected = {t: math.exp(lp) for t, lp in zip(out.token_ids, out.logprobs, strict=True)}
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-5)  # every reachable token was drawn
    statistic = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    assert statistic < 3 * len(expected) + 10, (statistic, counts, expected)


def test_greedy_rows_process_penalties_but_no_temperature() -> None:
    logits = random_logits(2, 30, seed=23)
    params = SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=0.5, logprobs=3)
    rows = [make_row(params, output=(1, 2, 5)), make_row(SamplingParams(temperature=0, logprobs=3))]
    raw = Sampler()(logits.clone(), rows)
    processed = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), rows)
    assert raw.token_ids == processed.token_ids
    penalised = torch.tensor(reference_penalties(logits[0].tolist(), [], [1, 2, 5], 1.8, 0.0, 0.5))
    expected = torch.log_softmax(penalised.double(), dim=0)
    assert processed.logprobs is not None and raw.logprobs is not None
    assert processed.logprobs[0] == pytest.approx(expected[processed.token_ids[0]].item(), abs=1e-5)
    assert raw.logprobs[0] != pytest.approx(processed.logprobs[0], abs=1e-3)  # raw: before the penalties
    assert raw.logprobs[1] == pytest.approx(processed.logprobs[1], abs=1e-6)  # nothing to process


def test_the_logits_modes_are_the_values_before_normalizing() -> None:
    logits = random_logits(2, 30, seed=24)
    rows = [
        make_row(SamplingParams(temperature=0.5, top_k=3, logprobs=5)),
        make_row(SamplingParams(logprobs=2)),
    ]
    raw = Sampler(logprobs_mode="raw_logits")(logits.clone(), rows)
    assert raw.logprobs is not None and raw.top_logprobs is not None
    for i in range(2):
        assert raw.logprobs[i] == pytest.approx(logits[i, raw.token_ids[i]].item(), abs=1e-6)
        best = logits[i].topk(len(raw.top_logprobs[i]))
        assert raw.top_logprobs[i] == [
            (t, pytest.approx(v, abs=1e-6))
            for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
    processed = Sampler(logprobs_mode="processed_logits")(logits.clone(), rows)
    assert processed.top_logprobs is not None and processed.logprobs is not None
    top3 = logits[0].topk(3)
    assert len(processed.top_logprobs[0]) == 3  # top_k=3: the other two asked for are impossible, left out
    assert [t for t, _ in processed.top_logprobs[0]] == top3.indices.tolist()
    assert [v for _, v in processed.top_logprobs[0]] == pytest.approx((top3.values / 0.5).tolist(), abs=1e-5)
    assert processed.logprobs[0] == pytest.approx(logits[0, processed.token_ids[0]].item() / 0.5, abs=1e-5)


@pytest.mark.parametrize("penalised", [False, True], ids=["plain", "penalised"])
def test_tokens_too_unlikely_for_float32_keep_their_processed_value(penalised: bool) -> None:
    """At T=0.1, tokens 15 logits below the best are exp(-150) away: 0 in a float32 draw, yet not cut. As in
    vLLM (log-softmax of the processed logits) they are listed with their finite value; tokens that top-k or
    top-p cut are not. A penalised row's logits are a copy the sampler could scale in place: the values must
    still be those before the picks."""
    vocab = 12
    logits = torch.tensor([[10.0, 9.0] + [-5.0 - 0.25 * i for i in range(vocab - 2)]] * 3)
    cold = {"temperature": 0.1, "logprobs": 5, "presence_penalty": 0.5 if penalised else 0.0}
    rows = [
        make_row(SamplingParams(**cold)),
        make_row(SamplingParams(**cold, top_k=3)),
        make_row(SamplingParams(**cold, top_p=0.99999)),  # keeps the second token, 4.5e-5 of the mass
    ]
    z = logits[0].double() / 0.1
    for mode in ("processed_logprobs", "processed_logits"):
        out = Sampler(logprobs_mode=mode)(logits.clone(), rows)
        assert out.top_logprobs is not None and out.logprobs is not None
        assert out.token_ids == [0, 0, 0]  # exp(-10) of the second token: the best, all but surely
        shift = torch.logsumexp(z, 0) if mode == "processed_logprobs" else 0.0
        top3 = torch.logsumexp(z[:3], 0) if mode == "processed_logprobs" else 0.0
        expected = [
            [(t, pytest.approx(float(z[t] - shift), rel=1e-5, abs=1e-4)) for t in range(5)],  # no truncation
            [(t, pytest.approx(float(z[t] - top3), rel=1e-5, abs=1e-4)) for t in range(3)],  # top-k keeps 3
            [
                (t, pytest.approx(float(z[t] - shift), rel=1e-5, abs=1e-4)) for t in range(2)
            ],  # top-p: mass only
        ]
        assert out.top_logprobs == expected, mode
        assert out.logprobs[0] == pytest.approx(float(z[0] - shift), abs=1e-4)


def test_processed_logprobs_see_the_mask() -> None:
    vocab = 64
    logits = random_logits(2, vocab, seed=25)
    allowed = [3, 9, 17, 40]
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    bitmask[1] = -1
    rows = [make_row(SamplingParams(temperature=0.6, logprobs=10)), make_row(SamplingParams(logprobs=1))]
    out = Sampler(logprobs_mode="processed_logprobs")(
        logits.clone(), rows, mask=TokenMask(bitmask=bitmask, rows=[0])
    )
    assert out.top_logprobs is not None and out.logprobs is not None
    assert out.token_ids[0] in allowed and set(_finite(out.top_logprobs[0])) == set(allowed)
    expected = torch.log_softmax(logits[0, allowed].double() / 0.6, dim=0)
    for token, value in out.top_logprobs[0]:
        assert value == pytest.approx(expected[allowed.index(token)].item(), abs=1e-5)


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, raw_logits"):
        EngineConfig(logprobs_mode="logits")
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="processed")
    assert EngineConfig().logprobs_mode == "raw_logprobs" == LOGPROBS_MODES[0]


def test_prompt_logprobs_follow_the_logits_half_of_the_mode() -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, logprobs=1)
    outputs = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs"):
        llm = LLM("tiny", kv_cache_tokens=512, logprobs_mode=mode)
        outputs[mode] = llm.generate([prompt], params)[0]
    logprobs, logits = outputs["raw_logprobs"], outputs["raw_logits"]
    assert logits.prompt_token_ids == logprobs.prompt_token_ids
    assert logprobs.outputs[0].token_ids == logits.outputs[0].token_ids
    for lp, lg in zip(logprobs.prompt_logprobs[1:], logits.prompt_logprobs[1:], strict=True):
        assert lp.rank == lg.rank and [t for t, _ in lp.top_logprobs] == [t for t, _ in lg.top_logprobs]
        # the logit and the logprob differ by the position's log-normalizer, the same for every token
        shift = lg.logprob - lp.logprob
        assert all(
            v - w == pytest.approx(shift, abs=1e-4)
            for (_, v), (_, w) in zip(lg.top_logprobs, lp.top_logprobs, strict=True)
        )
        assert lp.logprob <= 0 and shift > 0
    # greedy, no penalties: nothing to process, so processed_logprobs equal the raw ones
    processed = outputs["processed_logprobs"]
    assert [e.logprob for e in processed.prompt_logprobs[1:]] == [
        e.logprob for e in logprobs.prompt_logprobs[1:]
    ]
    assert processed.outputs[0].logprobs == logprobs.outputs[0].logprobs
