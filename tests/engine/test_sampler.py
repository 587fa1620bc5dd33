import math

import pytest
import torch
from sampling_reference import NEG_INF, reference_penalties, reference_probs

from structgen.engine.sampler import (
    Sampler,
    SamplerError,
    SamplingRow,
    make_generator,
)
from structgen.sampling_params import SamplingParams

EOS = 3


def make_row(
    params: SamplingParams,
    *,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    eos: frozenset[int] = frozenset({EOS}),
) -> SamplingRow:
    generator = make_generator(params.seed) if params.seed is not None else None
    return SamplingRow(params, list(prompt), list(output), generator, eos)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# Option sets every "must hold for all options" test runs through.
OPTIONS = {
    "greedy": SamplingParams(temperature=0),
    "greedy+penalties": SamplingParams(temperature=0, repetition_penalty=0.5, presence_penalty=-2.0),
    "temperature": SamplingParams(temperature=1.7),
    "top_k": SamplingParams(top_k=50),
    "top_p": SamplingParams(top_p=0.99),
    "min_p": SamplingParams(min_p=0.01),
    "penalties": SamplingParams(repetition_penalty=0.3, frequency_penalty=-2.0, presence_penalty=-2.0),
    "seeded+all": SamplingParams(
        temperature=1.3, top_k=200, top_p=0.98, min_p=0.001, seed=5, frequency_penalty=-1
    ),
    "min_tokens": SamplingParams(min_tokens=50, max_tokens=None, stop_token_ids=[4, 5]),
}


def test_greedy_is_argmax_and_accepts_bf16_logits() -> None:
    logits = random_logits(16, 1000, seed=0)
    logits[3, :990] = NEG_INF
    logits[4, 7] = logits[4, 9] = logits[4].max() + 1  # a tie: the lower id wins, as with torch.argmax
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=1).tolist()
    half = logits.bfloat16()
    assert Sampler()(half, rows).token_ids == half.float().argmax(dim=1).tolist()


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(4, 300, seed=1)
    before = logits.clone()
    rows = [
        make_row(SamplingParams(temperature=0.5, top_p=0.9, top_k=10, min_p=0.1), output=(1, 2)),
        make_row(SamplingParams(repetition_penalty=1.5), prompt=(4,), output=(5,)),
        make_row(SamplingParams(temperature=0, frequency_penalty=1.0), output=(6, 6)),
        make_row(SamplingParams(min_tokens=3)),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.8, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.4),
    ],
    ids=["plain", "temperature", "top_k", "top_p", "min_p", "combined", "penalties"],
)
def test_sampled_distribution_matches_the_reference(params: SamplingParams) -> None:
    draws, vocab = 20_000, 32
    logits = random_logits(1, vocab, seed=2, scale=1.5)[0]
    logits[[0, 9, 17]] = NEG_INF
    prompt, output = (1, 2, 2, 5), (5, 6, 6, 6, 9)
    expected = reference_probs(logits.tolist(), params, prompt, output)
    rows = [make_row(params, prompt=prompt, output=output) for _ in range(draws)]
    picks = Sampler(generator=torch.Generator().manual_seed(3))(logits.expand(draws, vocab), rows).token_ids
    counts = [0] * vocab
    for token in picks:
        counts[token] += 1
    support = [t for t in range(vocab) if expected[t] > 0]
    assert all(counts[t] == 0 for t in range(vocab) if expected[t] == 0)
    chi2 = sum((counts[t] - draws * expected[t]) ** 2 / (draws * expected[t]) for t in support)
    dof = max(len(support) - 1, 1)
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)
    assert all(counts[t] > 0 for t in support if expected[t] > 0.002)


def test_masked_tokens_stay_impossible_under_every_option() -> None:
    vocab, steps = 300, 25
    names = list(OPTIONS)
    gen = torch.Generator().manual_seed(4)
    sampler = Sampler(generator=torch.Generator().manual_seed(5))
    rows, allowed = [], []
    for i in range(4 * len(names)):
        size = 1 + i % 13
        allowed.append(
            set(torch.randperm(vocab, generator=gen)[:size].tolist()) | ({EOS} if i % 4 == 0 else set())
        )
        # The history repeats masked tokens, which the negative penalties push up.
        history = tuple(torch.randint(0, vocab, (30,), generator=gen).tolist())
        rows.append(
            make_row(OPTIONS[names[i % len(names)]].clone(), prompt=history[:10], output=history[10:])
        )
    rows.append(make_row(OPTIONS["min_tokens"].clone()))  # the grammar allows only EOS before min_tokens
    allowed.append({EOS})
    mask = torch.full((len(rows), vocab), NEG_INF)
    for i, ids in enumerate(allowed):
        mask[i, list(ids)] = 0.0
    for step in range(steps):
        logits = random_logits(len(rows), vocab, seed=100 + step, scale=4.0) + mask
        for i, token in enumerate(sampler(logits, rows).token_ids):
            assert token in allowed[i], (names[i % len(names)] if i < len(names) * 4 else "eos-only", step)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_row_with_nothing_allowed_is_an_error(name: str) -> None:
    logits = random_logits(3, 64, seed=6)
    logits[1] = NEG_INF
    rows = [
        make_row(SamplingParams()),
        make_row(OPTIONS[name].clone(), output=(1, 2)),
        make_row(SamplingParams()),
    ]
    with pytest.raises(SamplerError, match=r"row 1: every token is -inf") as info:
        Sampler()(logits, rows)
    assert info.value.rows == [1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["greedy", "top_p", "min_p"])
def test_nan_or_inf_logits_are_an_error(bad: float, name: str) -> None:
    logits = random_logits(2, 64, seed=7)
    logits[0, 10] = bad
    rows = [make_row(OPTIONS[name].clone()), make_row(SamplingParams())]
    with pytest.raises(
        SamplerError, match="row 0: its logits contain " + ("NaN" if math.isnan(bad) else r"\+inf")
    ):
        Sampler()(logits, rows)


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    for seed in range(3):
        logits = random_logits(32, 5000, seed=10 + seed)
        logits[::3, ::2] = NEG_INF
        argmax = logits.argmax(dim=1).tolist()
        for params in (SamplingParams(top_k=1, temperature=1.5), SamplingParams(top_p=1e-6, temperature=1.5)):
            assert Sampler()(logits, [make_row(params) for _ in range(32)]).token_ids == argmax


def test_greedy_applies_penalties_first() -> None:
    vocab = 30
    logits = random_logits(12, vocab, seed=8)
    gen = torch.Generator().manual_seed(9)
    rows, expected = [], []
    for i in range(12):
        params = SamplingParams(
            temperature=0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.5
        )
        prompt = tuple(torch.randint(0, vocab, (5,), generator=gen).tolist())
        output = tuple(torch.randint(0, vocab, (8,), generator=gen).tolist())
        rows.append(make_row(params, prompt=prompt, output=output))
        z = reference_penalties(logits[i].tolist(), prompt, output, 1.8, 0.7, 0.5)
        expected.append(max(range(vocab), key=lambda t, z=z: z[t]))
    assert Sampler()(logits, rows).token_ids == expected
    plain = logits.argmax(dim=1).tolist()
    assert expected != plain  # the penalties did change some picks


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 7], logits[0, 5] = 5.0, 4.0, 3.0  # EOS best, then stop id 7, then 5

    def pick(output_len: int, **kwargs: object) -> int:
        params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], **kwargs)
        return Sampler()(logits, [make_row(params, output=(1,) * output_len)]).token_ids[0]

    assert pick(0) == 5 and pick(1) == 5
    assert pick(2) == EOS
    assert pick(1, ignore_eos=True) == EOS  # ignore_eos: EOS is not banned, stop ids still are
    only_eos = torch.full((1, 10), NEG_INF)
    only_eos[0, EOS] = 0.0  # a finished grammar allows only EOS: it wins over min_tokens
    params = SamplingParams(temperature=0, min_tokens=5)
    assert Sampler()(only_eos, [make_row(params)]).token_ids == [EOS]


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.8, seed=1234),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.2, seed=1234),
        SamplingParams(temperature=1.2, top_p=0.95, min_p=0.02, seed=2**64 - 1),
    ],
    ids=["temperature", "top_k_top_p_penalty", "top_p_min_p"],
)
def test_seeded_rows_are_reproducible_across_batch_compositions(target: SamplingParams) -> None:
    vocab, steps = 2000, 12
    companions = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, seed=7),
        SamplingParams(top_p=0.5, frequency_penalty=1.0),
        SamplingParams(min_p=0.2, seed=99),
        SamplingParams(top_k=3),
        SamplingParams(temperature=1.5, min_tokens=4),
    ]

    def run(position: int, others: list[SamplingParams], params: SamplingParams = target) -> list[int]:
        rows = [make_row(p.clone()) for p in others]
        mine = make_row(params.clone(), prompt=(1, 2, 3))
        rows.insert(position, mine)
        torch.manual_seed(len(others) * 31 + position)  # the unseeded rows' draws differ between runs
        for step in range(steps):
            logits = random_logits(len(rows), vocab, seed=1000 * step + len(rows))
            logits[position] = random_logits(1, vocab, seed=step)[0]  # the target's own logits per step
            token = Sampler()(logits, rows).token_ids[position]
            mine.output_token_ids.append(token)
        return list(mine.output_token_ids)

    alone = run(0, [])
    assert len(set(alone)) > 1
    assert run(1, companions[:3]) == alone
    assert run(5, companions[::-1]) == alone
    assert run(7, companions) == alone
    other_seed = target.clone()
    other_seed.seed = 77
    assert run(0, [], other_seed) != alone  # a different seed gives a different sequence


def test_an_error_leaves_generators_untouched_for_the_rerun() -> None:
    logits = random_logits(3, 400, seed=14)
    params = SamplingParams(temperature=1.5, seed=8)
    clean = [make_row(params), make_row(SamplingParams(seed=9))]
    expected = [Sampler()(logits[[0, 2]], clean).token_ids for _ in range(5)]
    with_dead = [make_row(params), make_row(SamplingParams()), make_row(SamplingParams(seed=9))]
    dead = logits.clone()
    dead[1] = NEG_INF
    got = []
    for _ in range(5):
        with pytest.raises(SamplerError):
            Sampler()(dead, with_dead)
        good = [with_dead[0], with_dead[2]]
        got.append(Sampler()(logits[[0, 2]], good).token_ids)
    assert got == expected and len({tuple(t) for t in got}) > 1


def test_two_rows_with_the_same_seed_agree() -> None:
    logits = random_logits(1, 500, seed=11).expand(4, 500)
    params = SamplingParams(temperature=1.5, seed=42)
    rows = [make_row(params), make_row(SamplingParams()), make_row(params), make_row(SamplingParams(seed=43))]
    for _ in range(10):
        picks = Sampler()(logits, rows).token_ids
        assert picks[0] == picks[2]


def test_logprobs_are_the_raw_distribution_and_top_logprobs_are_sorted() -> None:
    vocab = 100
    logits = random_logits(5, vocab, seed=12)
    logits[3, 3:] = NEG_INF  # only three tokens possible, but 20 asked for
    rows = [
        make_row(SamplingParams(temperature=0, logprobs=5)),
        make_row(SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=0), output=(1, 2, 3)),
        make_row(SamplingParams()),
        make_row(SamplingParams(logprobs=20, top_p=0.9)),
        make_row(SamplingParams(temperature=2.0, top_k=10, logprobs=1)),
    ]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, token in enumerate(out.token_ids):
        if rows[i].params.logprobs is None:
            assert math.isnan(out.logprobs[i])  # not asked, not computed
        else:
            assert out.logprobs[i] == pytest.approx(reference[i, token].item(), abs=1e-5)
    for i, k in [(0, 5), (3, 3), (4, 1)]:
        top = out.top_logprobs[i]
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        best = reference[i].topk(k)
        assert [t for t, _ in top] == best.indices.tolist()
        assert values == pytest.approx(best.values.tolist(), abs=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    assert out.top_logprobs[0][0][0] == out.token_ids[0]  # greedy picks the most likely token


def test_logprobs_are_none_unless_asked() -> None:
    logits = random_logits(2, 50, seed=13)
    out = Sampler()(logits, [make_row(SamplingParams()), make_row(SamplingParams(temperature=0))])
    assert out.logprobs is None and out.top_logprobs is None
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0)), make_row(SamplingParams(logprobs=0))])
    assert out.logprobs is not None and len(out.logprobs) == 2 and out.top_logprobs is None
    assert math.isnan(out.logprobs[0])
    expected = torch.log_softmax(logits[1].double(), dim=0)[out.token_ids[1]].item()
    assert out.logprobs[1] == pytest.approx(expected, abs=1e-5)


def test_bad_inputs_are_clear_errors() -> None:
    row = make_row(SamplingParams())
    with pytest.raises(ValueError, match="2-D floating-point tensor"):
        Sampler()(torch.zeros(5), [row])
    with pytest.raises(ValueError, match="2-D floating-point tensor"):
        Sampler()(torch.zeros(1, 5, dtype=torch.long), [row])
    with pytest.raises(ValueError, match="logits have 2 rows but 1 SamplingRows"):
        Sampler()(torch.zeros(2, 5), [row])
    unseeded = SamplingRow(SamplingParams(seed=3), [], [], None, frozenset())
    with pytest.raises(ValueError, match=r"row 0: params\.seed is set but the row has no generator"):
        Sampler()(torch.zeros(1, 5), [unseeded])
    with pytest.raises(ValueError, match="row 0: output token id 7 is outside the vocabulary"):
        Sampler()(torch.zeros(1, 5), [make_row(SamplingParams(presence_penalty=1.0), output=(7,))])
    assert Sampler()(torch.zeros(0, 5), []).token_ids == []
