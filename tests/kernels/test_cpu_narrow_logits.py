"""The native narrow rows' logits (`cpu_narrow_logits`) against their torch reference: both dtypes of weight and
hidden state, rows allowing from no token to thousands, every thread count's split of the rows, and bad calls."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import torch_threads
from structgen.kernels import cpu_build, cpu_narrow_logits

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_narrow_logits.available(), (
        f"native CPU kernels did not build: {cpu_build.unavailable_reason()}"
    )


def _case(
    weight_dtype: torch.dtype, hidden_dtype: torch.dtype, *, vocab: int = 3000, size: int = 72, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, size, generator=gen) * 0.1).to(weight_dtype)
    hidden = torch.randn(7, size, generator=gen).to(hidden_dtype)
    rows = [5, 0, 3, 6]
    ids = [
        torch.tensor([0, vocab - 1]),
        torch.randperm(vocab, generator=gen)[:2048].sort().values,
        torch.tensor([], dtype=torch.long),
        torch.tensor([17]),
    ]
    return weight, hidden, rows, ids


@pytest.mark.parametrize("hidden_dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_matches_the_reference(weight_dtype: torch.dtype, hidden_dtype: torch.dtype, threads: int) -> None:
    weight, hidden, rows, ids = _case(weight_dtype, hidden_dtype)
    out = torch.full((7, weight.shape[0]), 5.0)
    expected = out.clone()
    with torch_threads(threads):
        cpu_narrow_logits.narrow_logits_rows(weight, hidden, rows, ids, out)
    cpu_narrow_logits.narrow_logits_reference(weight, hidden, rows, ids, expected)
    # float32 sums in another order; a bf16 weight rounds them to bf16 after, where they may land one ulp apart.
    tolerance = (
        {"rtol": 8e-3, "atol": 1e-3} if weight_dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    )
    torch.testing.assert_close(out, expected, **tolerance)
    untouched = [r for r in range(7) if r not in rows]
    assert bool((out[untouched] == 5.0).all())
    for row, allowed in zip(rows, ids, strict=True):
        rest = torch.ones(weight.shape[0], dtype=torch.bool)
        rest[allowed] = False
        assert bool(torch.isneginf(out[row, rest]).all())
        if weight_dtype == torch.bfloat16:  # rounded to the weight's dtype, as the full product's output is
            values = out[row, allowed]
            assert torch.equal(values, values.bfloat16().float())


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    weight, hidden, _, _ = _case(torch.bfloat16, torch.bfloat16, seed=1)
    ids = torch.arange(0, 3000, 7)
    alone = torch.empty(7, 3000)
    cpu_narrow_logits.narrow_logits_rows(weight, hidden, [2], [ids], alone)
    crowded = torch.empty(7, 3000)
    others = [torch.randperm(3000)[:1500].sort().values for _ in range(6)]
    cpu_narrow_logits.narrow_logits_rows(
        weight, hidden, [0, 1, 2, 3, 4, 5, 6], [*others[:2], ids, *others[2:]], crowded
    )
    assert torch.equal(alone[2], crowded[2])


def test_bad_calls_are_refused() -> None:
    weight, hidden, rows, ids = _case(torch.float32, torch.float32)
    out = torch.empty(7, weight.shape[0])
    with pytest.raises(ValueError, match="token id 3000 out of range"):
        cpu_narrow_logits.narrow_logits_rows(weight, hidden, [1], [torch.tensor([3000])], out)
    with pytest.raises(ValueError, match="row 9 out of range"):
        cpu_narrow_logits.narrow_logits_rows(weight, hidden, [9], [torch.tensor([1])], out)
    with pytest.raises(ValueError, match="one ids tensor per row"):
        cpu_narrow_logits.narrow_logits_rows(weight, hidden, rows, ids[:2], out)
    with pytest.raises(ValueError, match="float32"):
        cpu_narrow_logits.narrow_logits_rows(weight, hidden, rows, ids, out.double())
    with pytest.raises(ValueError, match="int64"):
        cpu_narrow_logits.narrow_logits_rows(weight, hidden, [1], [torch.tensor([1], dtype=torch.int32)], out)
    with pytest.raises(ValueError, match="hidden"):
        cpu_narrow_logits.narrow_logits_rows(weight, hidden[:, :10], [1], [torch.tensor([1])], out)
