"""The structured-output mask applied lazily by the sampler: picks equal the eagerly masked ones (greedy),
draws follow the masked distribution (sampling), and rows that need the whole masked distribution are masked
first."""

from __future__ import annotations

import math

import pytest
import torch
from sampling_reference import NEG_INF, reference_probs
from test_sampler import make_row, random_logits

from structgen.engine.fast_picks import SPARSE_LIMIT
from structgen.engine.sampler import Sampler, SamplerError
from structgen.engine.token_mask import TokenMask, _bits_by_tensor_ops, _bits_on_cpu
from structgen.sampling_params import SamplingParams
from structgen.structured.bitmask import allocate_token_bitmask, allow_tokens, apply_token_bitmask_


def mask_allowing(vocab: int, allowed: list[list[int]]) -> torch.Tensor:
    bitmask = allocate_token_bitmask(len(allowed), vocab)
    bitmask.zero_()
    for row, ids in enumerate(allowed):
        allow_tokens(bitmask, row, ids)
    return bitmask


def test_allows_reads_one_bit_per_row_and_subset_reindexes() -> None:
    bitmask = mask_allowing(100, [[0, 31, 32, 99], [5], [63]])
    mask = TokenMask(bitmask=bitmask, rows=[0, 2])
    assert mask.allows([0, 0, 0, 0, 0], torch.tensor([0, 31, 32, 99, 1])) == [True, True, True, True, False]
    assert mask.allows([1, 2, 2], torch.tensor([5, 63, 62])) == [True, True, False]
    assert mask.allows([0], torch.tensor([100_000])) == [False]  # beyond the mask: never allowed
    sub = mask.subset([2, 1])
    assert sub.rows == [0] and sub.allows([0, 1], torch.tensor([63, 5])) == [True, True]


def test_the_cpu_bit_reader_matches_the_tensor_one() -> None:
    """`allows` reads bits through a numpy view on the CPU and through tensor ops elsewhere: the same answers,
    bit 31 of a word (a negative int32) and tokens past the mask's width included."""
    gen = torch.Generator().manual_seed(5)
    vocab = 1_000
    allowed = [
        [*torch.randperm(vocab, generator=gen)[: 50 * (r + 1)].tolist(), 31, 63, 991] for r in range(4)
    ]
    bitmask = mask_allowing(vocab, allowed)
    assert int(bitmask.min()) < 0  # some words have their top bit set
    rows = [r for r in range(4) for _ in range(300)]
    tokens = torch.randint(0, bitmask.shape[1] * 32 + 40, (len(rows),), generator=gen).tolist()
    tokens[:3] = [31, 63, bitmask.shape[1] * 32]
    expected = [token in allowed[row] for row, token in zip(rows, tokens, strict=True)]
    assert _bits_on_cpu(bitmask, rows, tokens) == expected
    assert _bits_by_tensor_ops(bitmask, rows, tokens) == expected


@pytest.mark.parametrize("seed", range(4))
def test_greedy_lazy_picks_equal_eager_picks(seed: int) -> None:
    batch, vocab = 12, 300
    logits = random_logits(batch, vocab, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    allowed = [torch.randperm(vocab, generator=gen)[: 1 + r * 20].tolist() for r in range(batch)]
    # Some rows allow their own argmax (no masking needed), others do not.
    allowed[0].append(int(logits[0].argmax()))
    bitmask = mask_allowing(vocab, allowed)
    constrained = [r for r in range(batch) if r % 3 != 1]
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(batch)]
    eager = logits.clone()
    apply_token_bitmask_(eager, bitmask, rows=constrained)
    expected = Sampler()(eager, rows).token_ids
    lazy = logits.clone()
    got = Sampler()(lazy, rows, mask=TokenMask(bitmask=bitmask, rows=constrained)).token_ids
    assert got == expected
    for r in constrained:
        assert got[r] in allowed[r]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(presence_penalty=1.5, temperature=1.2),
    ],
    ids=["plain", "temperature", "penalties"],
)
def test_lazy_draws_follow_the_masked_distribution(params: SamplingParams) -> None:
    draws, vocab = 20_000, 32
    logits = random_logits(1, vocab, seed=7, scale=1.5)[0]
    allowed = [1, 2, 3, 8, 9, 20, 30]  # excludes the likeliest tokens more often than not
    bitmask = mask_allowing(vocab, [allowed]).expand(draws, -1).contiguous()
    masked = torch.full((vocab,), NEG_INF)
    masked[allowed] = logits[allowed]
    prompt, output = (1, 2), (3, 3, 9)
    expected = reference_probs(masked.tolist(), params, prompt, output)
    rows = [make_row(params, prompt=prompt, output=output) for _ in range(draws)]
    sampler = Sampler(generator=torch.Generator().manual_seed(3))
    mask = TokenMask(bitmask=bitmask, rows=list(range(draws)))
    picks = sampler(logits.expand(draws, vocab).clone(), rows, mask=mask).token_ids
    counts = [picks.count(t) for t in range(vocab)]
    assert all(counts[t] == 0 for t in range(vocab) if t not in allowed)
    chi2 = sum((counts[t] - draws * expected[t]) ** 2 / (draws * expected[t]) for t in allowed)
    dof = len(allowed) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_truncation_and_logprob_rows_see_the_masked_distribution() -> None:
    vocab = 50
    logits = random_logits(2, vocab, seed=1)
    best = logits.argmax(dim=1).tolist()
    allowed = [[t for t in range(vocab) if t != best[r]][:10] for r in range(2)]
    bitmask = mask_allowing(vocab, allowed)
    rows = [make_row(SamplingParams(top_k=1)), make_row(SamplingParams(temperature=0, logprobs=3))]
    out = Sampler()(logits.clone(), rows, mask=TokenMask(bitmask=bitmask, rows=[0, 1]))
    for r in range(2):  # top_k=1 over the masked distribution is its argmax, not the unmasked one's
        expected = max(allowed[r], key=lambda t, r=r: float(logits[r, t]))
        assert out.token_ids[r] == expected
    assert out.top_logprobs is not None and {t for t, _ in out.top_logprobs[1]} <= set(allowed[1])
    masked = torch.full((vocab,), NEG_INF)
    masked[allowed[1]] = logits[1, allowed[1]]
    assert out.logprobs is not None
    assert math.isclose(out.logprobs[1], float(masked.log_softmax(0)[out.token_ids[1]]), rel_tol=1e-5)


def test_a_lazy_row_with_nothing_allowed_is_an_error_naming_the_mask() -> None:
    logits = random_logits(3, 40, seed=0)
    bitmask = mask_allowing(40, [[1], [], [2]])
    rows = [make_row(SamplingParams(temperature=0)), make_row(SamplingParams()), make_row(SamplingParams())]
    with pytest.raises(SamplerError, match="structured-output mask") as error:
        Sampler()(logits, rows, mask=TokenMask(bitmask=bitmask, rows=[0, 1, 2]))
    assert error.value.rows == [1]


@pytest.mark.parametrize("vocab", [64, 4 * SPARSE_LIMIT])
def test_rejections_are_recorded_and_hinted_rows_skip_the_unmasked_pick(vocab: int) -> None:
    logits = random_logits(3, vocab, seed=4)
    best = logits.argmax(dim=1).tolist()
    # Rows 0 and 2 forbid their argmax; hinted row 1 allows its own.
    allowed = [[t for t in range(vocab) if t != best[r] or r == 1] for r in range(3)]
    bitmask = mask_allowing(vocab, allowed)
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(3)]
    mask = TokenMask(bitmask=bitmask, rows=[0, 1, 2], eager=[1])
    picks = Sampler()(logits.clone(), rows, mask=mask).token_ids
    eager = logits.clone()
    apply_token_bitmask_(eager, bitmask, rows=[0, 1, 2])
    assert picks == eager.argmax(dim=1).tolist()
    # Rows 0 and 2 were rejected. Hinted row 1 stays hinted while its mask allows few tokens (it was picked
    # among them); with a wide-open mask it went back to the lazy path and its pick was accepted.
    assert mask.rejected == ([0, 1, 2] if vocab <= SPARSE_LIMIT else [0, 2])


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_rows_allowing_few_tokens_pick_among_them_like_the_masked_row(temperature: float) -> None:
    batch, vocab = 64, 5000
    logits = random_logits(batch, vocab, seed=5, scale=3.0)
    gen = torch.Generator().manual_seed(5)
    allowed = [torch.randperm(vocab, generator=gen)[: 1 + 7 * r].tolist() for r in range(batch)]
    allowed[3] = list(range(0, vocab, 2))  # wide open: masked whole
    bitmask = mask_allowing(vocab, allowed)

    rows = [make_row(SamplingParams(temperature=temperature, seed=s)) for s in range(batch)]
    every_row = list(range(batch))  # all hinted: picked among their allowed tokens where those are few
    picks = Sampler()(logits.clone(), rows, mask=TokenMask(bitmask, every_row, eager=every_row)).token_ids
    assert all(p in allowed[r] for r, p in enumerate(picks))
    if temperature == 0.0:
        masked = logits.clone()
        apply_token_bitmask_(masked, bitmask)
        assert picks == masked.argmax(dim=1).tolist()
    else:  # the same uniform drives the same CDF position whether the row is masked whole or gathered
        rows = [make_row(SamplingParams(temperature=temperature, seed=s)) for s in range(batch)]
        masked = logits.clone()
        apply_token_bitmask_(masked, bitmask)
        expected = Sampler()(masked, rows).token_ids
        # Row 3's mask is wide open: it is picked lazily (other draws), not among its allowed tokens.
        assert [p for r, p in enumerate(picks) if r != 3] == [p for r, p in enumerate(expected) if r != 3]


def test_rejected_sampled_rows_draw_again_before_any_masking() -> None:
    # Token 0 holds 85% of the mass and is forbidden: most first draws are rejected, and most of those are
    # settled by the candidates drawn again from the unmasked distribution; only rows whose every candidate
    # lands on it (0.85^16, 7% of the rejected ones, in expectation) fall back to the mask (here: a pick among
    # the 15 allowed).
    draws, vocab = 400, 16
    logits = torch.zeros(vocab)
    logits[0] = math.log((vocab - 1) * 0.85 / 0.15)
    rows = [make_row(SamplingParams(seed=s)) for s in range(draws)]
    unmasked = Sampler()(logits.expand(draws, vocab).clone(), rows).token_ids
    first_rejected = sum(t == 0 for t in unmasked)
    bitmask = mask_allowing(vocab, [list(range(1, vocab))]).expand(draws, -1).contiguous()
    mask = TokenMask(bitmask=bitmask, rows=list(range(draws)))
    rows = [make_row(SamplingParams(seed=s)) for s in range(draws)]
    picks = Sampler()(logits.expand(draws, vocab).clone(), rows, mask=mask).token_ids
    assert 0 not in picks
    assert 300 < first_rejected < 380
    assert 5 < len(mask.rejected) < first_rejected / 4
    # Rows the first draw did not reject keep exactly the token they got without a mask.
    assert all(p == u for p, u in zip(picks, unmasked, strict=True) if u != 0)
