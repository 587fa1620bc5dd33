"""Rows whose lazy pick the mask keeps rejecting, and whose mask allows too many tokens to list: drawn from the
first pick's probabilities restricted to the mask (`Draws.under_mask`), or, with too little allowed mass for
float32, masked and picked from their logits. Either way the draws follow the masked distribution."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampler import make_row
from test_token_mask import mask_allowing

from structgen.engine.fast_picks import SPARSE_LIMIT
from structgen.engine.inverse_cdf import InverseCdf
from structgen.engine.redraw import MIN_MASS, Draws
from structgen.engine.sampler import Sampler
from structgen.engine.token_mask import TokenMask
from structgen.sampling_params import SamplingParams

VOCAB = 2 * SPARSE_LIMIT + 8
ALLOWED = list(range(1, SPARSE_LIMIT + 100))  # more than the sampler lists: the row is drawn whole
FAVOURED = [1, 2, 3, 4, 5]  # the allowed tokens with mass; the other allowed ones are far less likely


def _logits(forbidden_logit: float) -> torch.Tensor:
    """Token 0 (forbidden) holds nearly all the mass: every unmasked draw lands on it."""
    logits = torch.full((VOCAB,), -40.0)
    logits[0] = forbidden_logit
    logits[FAVOURED] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0])
    return logits


def _masked_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    masked = torch.full_like(logits, float("-inf"))
    masked[ALLOWED] = logits[ALLOWED]
    return (masked.double() / temperature).softmax(0)


@pytest.mark.parametrize(
    ("forbidden_logit", "temperature"),
    [(12.0, 1.0), (12.0, 0.7), (60.0, 1.0)],
    ids=["kept-probs", "kept-probs-temperature", "too-little-mass"],
)
def test_rows_still_rejected_follow_the_masked_distribution(
    forbidden_logit: float, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int]] = []  # (rows given, rows left to the caller) of each `under_mask`
    under_mask = Draws.under_mask

    def spy(self: Draws, rows: list[int], *args: object) -> list[int]:
        left = under_mask(self, rows, *args)  # type: ignore[arg-type]
        seen.append((len(rows), len(left)))
        return left

    monkeypatch.setattr(Draws, "under_mask", spy)
    draws = 4000
    logits = _logits(forbidden_logit)
    allowed_mass = float(torch.exp((logits[FAVOURED] - forbidden_logit) / temperature).sum())
    assert (allowed_mass >= MIN_MASS) == (forbidden_logit < 30)  # which of the two ways the rows go
    bitmask = mask_allowing(VOCAB, [ALLOWED]).expand(draws, -1).contiguous()
    mask = TokenMask(bitmask=bitmask, rows=list(range(draws)))
    rows = [make_row(SamplingParams(temperature=temperature, seed=s)) for s in range(draws)]
    picks = Sampler()(logits.expand(draws, VOCAB).clone(), rows, mask=mask).token_ids
    assert len(mask.rejected) > 0.99 * draws  # (nearly) every row went past its unmasked redraws
    ((given, left),) = seen
    assert given == len(mask.rejected) and left == (given if allowed_mass < MIN_MASS else 0)
    expected = _masked_probs(logits, temperature)
    assert all(p in ALLOWED for p in picks)
    counts = [picks.count(t) for t in FAVOURED]
    rest = draws - sum(counts)  # the far less likely allowed tokens, as one bin
    bins = [*counts, rest]
    probs = [float(expected[t]) for t in FAVOURED]
    probs.append(1.0 - sum(probs))
    chi2 = sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(bins, probs, strict=True) if p > 1e-9)
    assert rest == 0 and probs[-1] < 1e-9
    dof = len(FAVOURED) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, bins)


def test_under_mask_leaves_greedy_rows_and_rows_without_mass_to_the_caller() -> None:
    vocab = 64
    probs = torch.zeros(3, vocab)
    probs[0, 0] = 1.0  # batch row 1: only token 0 has mass, and the mask forbids it
    probs[1, 0], probs[1, 7] = 1.0, 0.25  # batch row 3: token 7 is allowed
    probs[2, 0], probs[2, 9] = 1.0, MIN_MASS / 4  # batch row 4: allowed mass below MIN_MASS
    draws = Draws(InverseCdf(probs), {1: 0, 3: 1, 4: 2})
    bitmask = mask_allowing(vocab, [list(range(1, vocab))] * 5)
    mask = TokenMask(bitmask=bitmask, rows=list(range(5)))
    token_ids = torch.zeros(5, dtype=torch.long)
    ok = torch.ones(5, dtype=torch.bool)
    left = draws.under_mask([0, 1, 3, 4], token_ids, ok, mask, lambda rows: torch.rand(len(rows)).double())
    assert left == [0, 1, 4]  # 0: not sampled (greedy); 1: nothing allowed has mass; 4: too little
    assert int(token_ids[3]) == 7 and bool(ok[3])
    assert token_ids[[0, 1, 4]].tolist() == [0, 0, 0]  # untouched


def test_under_mask_fills_the_rows_it_reads() -> None:
    """Off the CPU nothing fills a rejected row's mask before `under_mask` reads it (the CPU's sparse split
    does): it must fill them itself, not draw under whatever bits an earlier step left in the row (seen on a
    GPU: every sampled structured request failed with "the grammar rejected tokens it had allowed")."""
    vocab = 64
    probs = torch.zeros(2, vocab)
    probs[:, 0], probs[:, 5], probs[:, 9] = 1.0, 0.5, 0.5
    draws = Draws(InverseCdf(probs), {0: 0, 1: 1})
    bitmask = mask_allowing(vocab, [list(range(vocab))] * 2)  # stale bits: everything allowed
    filled: list[list[int]] = []

    def fill(rows: list[int]) -> None:
        filled.append(rows)
        for row in rows:
            bitmask[row].zero_()
            bitmask[row, 0] = 1 << 9  # the grammar allows token 9 alone

    mask = TokenMask(
        bitmask=bitmask, rows=[0, 1], unfilled={0: lambda t: t == 9, 1: lambda t: t == 9}, fill=fill
    )
    token_ids = torch.zeros(2, dtype=torch.long)
    ok = torch.zeros(2, dtype=torch.bool)
    left = draws.under_mask([0, 1], token_ids, ok, mask, lambda rows: torch.rand(len(rows)).double())
    assert left == [] and filled == [[0, 1]] and not mask.unfilled
    assert token_ids.tolist() == [9, 9] and ok.tolist() == [True, True]


def test_candidates_drawn_again_follow_the_masked_distribution() -> None:
    """`Draws.again`: the first of a row's candidates its mask allows is a draw of p restricted to the mask."""
    rows, vocab = 4000, 8
    probs = torch.tensor([7.0, 1.0, 0.5, 0.25, 0.25, 0.0, 0.0, 1.0]).expand(rows, vocab).contiguous()
    draws = Draws(InverseCdf(probs), {i: i for i in range(rows)})
    allowed = [1, 2, 3, 4]  # 2.0 of the 10.0: a row's sixteen candidates all miss 0.8^16 = 2.8% of the time
    mask = TokenMask(bitmask=mask_allowing(vocab, [allowed] * rows), rows=list(range(rows)))
    token_ids = torch.zeros(rows, dtype=torch.long)
    used: list[tuple[int, int]] = []

    def uniforms(batch_rows: list[int], per_row: int) -> torch.Tensor:
        used.append((len(batch_rows), per_row))
        return torch.rand(len(batch_rows) * per_row, dtype=torch.float64)

    left = draws.again(list(range(rows)), token_ids, mask, uniforms)
    assert used == [(rows, 16)]  # one call for every row
    assert 0.01 * rows < len(left) < 0.05 * rows
    settled = [int(t) for i, t in enumerate(token_ids) if i not in set(left)]
    assert all(t in allowed for t in settled) and all(int(token_ids[i]) == 0 for i in left)
    expected = [1.0 / 2, 0.5 / 2, 0.25 / 2, 0.25 / 2]
    counts = [settled.count(t) for t in allowed]
    n = len(settled)
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected, strict=True))
    assert chi2 < 3 + 5 * math.sqrt(6), counts


def test_first_allowed_checks_in_order_and_stops_at_the_first() -> None:
    vocab = 64
    checked: list[int] = []

    def check(token: int) -> bool:
        checked.append(token)
        return token % 2 == 1

    mask = TokenMask(
        bitmask=mask_allowing(vocab, [[5, 9], [5, 9]]),
        rows=[0, 1],
        unfilled={1: check},
        fill=lambda rows: None,
    )
    assert mask.first_allowed(0, [4, 9, 5]) == 9 and mask.first_allowed(0, [1, 2, 99]) is None
    assert mask.first_allowed(1, [4, 6, 7, 3]) == 7 and checked == [4, 6, 7]  # the grammar's check, in order
    assert mask.first_allowed(1, [vocab * 2 + 1]) is None and checked == [4, 6, 7]  # past the mask: not asked
