"""The sampler's native inverse-CDF draw (`cpu_inverse_cdf`) against its reference (`InverseCdf.draw_reference`):
the same token for every uniform, over whole batches and row subsets, vocabularies that do and do not fill their
last block, zero-mass stretches, uniforms at the ends of [0, 1), plus the launcher's checks."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_build, cpu_inverse_cdf

from structgen.engine import inverse_cdf
from structgen.engine.inverse_cdf import CDF_BLOCK, InverseCdf


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_inverse_cdf.available(), f"native CPU kernels did not build: {cpu_build.unavailable_reason()}"


def _probs(batch: int, vocab: int, *, seed: int) -> torch.Tensor:
    """Unnormalized probabilities as the sampler makes them (exp of logits minus the max), with zeroed runs."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 4
    probs = (logits - logits.amax(dim=1, keepdim=True)).exp_()
    probs[0, : vocab // 2] = 0.0  # a row whose first half is impossible (whole zero blocks)
    if batch > 1:
        probs[1] = 0.0
        probs[1, vocab - 1] = 1e-30  # all the mass on the last token, a tiny one
    if batch > 2:
        probs[2, 1::2] = 0.0  # every other token impossible: zero entries inside each block
    return probs


def _uniforms(n: int, *, seed: int) -> torch.Tensor:
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    u[0] = 0.0
    if n > 1:
        u[1] = 1.0 - 2.0**-53  # the largest float64 below 1
    return u


@pytest.mark.parametrize("vocab", [100_288, 49_152, 3 * CDF_BLOCK + 7, 600])
def test_native_draw_matches_the_reference(vocab: int) -> None:
    probs = _probs(6, vocab, seed=vocab)
    cdf = InverseCdf(probs)
    for seed in range(20):
        u = _uniforms(6, seed=seed)
        assert torch.equal(cpu_inverse_cdf.draw(probs, cdf.block_cum, u, cdf.block), cdf.draw_reference(u))
        rows = torch.tensor([4, 0, 2, 2, 5])  # any order, repeats allowed
        subset = _uniforms(5, seed=100 + seed)
        assert torch.equal(
            cpu_inverse_cdf.draw(probs, cdf.block_cum, subset, cdf.block, rows),
            cdf.draw_reference(subset, rows),
        )


def test_draw_takes_the_native_path_and_never_lands_on_zero_mass() -> None:
    probs = _probs(3, 10_000, seed=1)
    cdf = InverseCdf(probs)
    assert inverse_cdf._native() is cpu_inverse_cdf
    u = torch.rand(3 * 400, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rows = torch.arange(3).repeat(400)
    drawn = cdf.draw(u, rows)
    assert torch.equal(drawn, cdf.draw_reference(u, rows))
    assert bool((probs[rows, drawn] > 0).all())
    assert set(drawn[rows == 1].tolist()) == {9_999}


def test_a_row_without_mass_draws_a_token_in_range() -> None:
    probs = torch.zeros(2, 3_000)
    probs[1, 5] = 1.0
    cdf = InverseCdf(probs)
    assert cdf.ok.tolist() == [False, True]  # the caller reports the dead row; the draw must not fail on it
    drawn = cpu_inverse_cdf.draw(
        probs, cdf.block_cum, torch.tensor([0.5, 0.5], dtype=torch.float64), cdf.block
    )
    assert 0 <= int(drawn[0]) < 3_000 and int(drawn[1]) == 5


def test_launcher_checks() -> None:
    probs = _probs(2, 2_000, seed=2)
    cdf = InverseCdf(probs)
    u = torch.tensor([0.1, 0.2], dtype=torch.float64)
    with pytest.raises(ValueError, match="probs must be"):
        cpu_inverse_cdf.draw(probs.double(), cdf.block_cum, u, cdf.block)
    with pytest.raises(ValueError, match="block_cum must be"):
        cpu_inverse_cdf.draw(probs, cdf.block_cum.float(), u, cdf.block)
    with pytest.raises(ValueError, match="do not cover"):
        cpu_inverse_cdf.draw(probs, cdf.block_cum, u, 512)
    with pytest.raises(ValueError, match="one uniform per row"):
        cpu_inverse_cdf.draw(probs, cdf.block_cum, u[:1], cdf.block)
    with pytest.raises(ValueError, match="out of range"):
        cpu_inverse_cdf.draw(probs, cdf.block_cum, u, cdf.block, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="one per uniform"):
        cpu_inverse_cdf.draw(probs, cdf.block_cum, u, cdf.block, torch.tensor([0]))
