"""Inverse-CDF draws: tiny tail masses are reachable, zero-probability tokens never, and drawing again from a
subset of rows reads the same distributions."""

import torch
from torch import Tensor

from structgen.engine.inverse_cdf import CDF_BLOCK, InverseCdf, search


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    cdf = InverseCdf(probs)
    return cdf.draw(uniforms), cdf.ok


def test_inverse_cdf_keeps_tiny_tail_mass() -> None:
    # One token holds 99.8% of the mass; 100k others share 0.2%, each ~2e-8: below half an ulp of 1.0,
    # so a float32 cumsum that accumulates in float32 (CUDA) would never reach them.
    vocab, draws, tail = 100_352, 5000, 0.002
    probs = torch.full((vocab,), tail / (vocab - 1))
    probs[0] = 1 - tail
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws  # stratified: exact quantiles
    tokens, ok = inverse_cdf(probs.expand(draws, vocab), uniforms)
    assert bool(ok.all())
    in_tail = int((tokens > 0).sum())
    assert abs(in_tail - tail * draws) <= 2
    # The tail is uniform, so the stratified draws that land in it are spread evenly across it.
    for i in range(draws - in_tail, draws):
        fraction = ((i + 0.5) / draws - (1 - tail)) / tail
        assert abs(int(tokens[i]) - (1 + fraction * (vocab - 1))) < vocab / 1000


def test_inverse_cdf_resolves_each_tiny_token() -> None:
    # 4,095 tokens of 2e-8 each after one of ~1: float32 steps near 1.0 (6e-8) could reach only a third of
    # them; every one must get its share of evenly spread draws.
    vocab, tiny, per_token = 4096, 2e-8, 3
    probs = torch.full((vocab,), tiny)
    probs[0] = 1 - tiny * (vocab - 1)
    draws = per_token * (vocab - 1)
    total = float(probs.double().sum())
    start = float(probs[0]) / total
    uniforms = start + (torch.arange(draws, dtype=torch.float64) + 0.5) / draws * (1 - start)
    tokens, _ = inverse_cdf(probs.expand(draws, vocab), uniforms)
    hits = torch.bincount(tokens, minlength=vocab)[1:]
    assert int(hits.min()) >= per_token - 1 and int(hits.max()) <= per_token + 1


def test_inverse_cdf_never_lands_on_zero_probability() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]]).expand(6, 6)
    below_one = torch.nextafter(
        torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    )
    uniforms = torch.tensor([0.0, 0.25, 0.4999999, 0.5, 0.75, below_one.item()], dtype=torch.float64)
    tokens, ok = inverse_cdf(probs, uniforms)
    assert tokens.tolist() == [1, 1, 1, 3, 3, 3] and bool(ok.all())
    # A target that rounding put at (or past) the total lands on the last token with mass, not after it.
    cum = torch.tensor([[0.0, 0.5, 0.5, 1.0, 1.0, 1.0]])
    assert search(cum, torch.tensor([[1.0]])).item() == 3
    assert search(cum, torch.tensor([[1.5]])).item() == 3


def test_drawing_from_a_subset_of_rows_equals_drawing_from_those_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 3 * CDF_BLOCK + 17  # a short last block too
    probs = torch.rand(6, vocab, generator=gen) ** 8
    probs[2, : vocab // 2] = 0.0
    cdf = InverseCdf(probs)
    uniforms = torch.rand(6, dtype=torch.float64, generator=gen)
    everything = cdf.draw(uniforms)
    rows = torch.tensor([4, 2, 5])
    assert torch.equal(cdf.draw(uniforms[rows], rows), everything[rows])
    assert bool((everything[2] >= vocab // 2).item())


def test_repeated_draws_follow_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]])
    cdf = InverseCdf(probs.expand(1, 4).contiguous())
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[cdf.draw(torch.rand(1, dtype=torch.float64, generator=gen), torch.tensor([0]))] += 1
    assert counts[1] == 0
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.0, 0.25, 0.25]), atol=0.03)
