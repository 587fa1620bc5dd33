"""The segmented LoRA kernel (`kernels/csrc/cpu_lora.cpp`) against its torch reference, and its refusals."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_lora

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="native CPU kernels unavailable")


def problem(
    *,
    tokens: int,
    in_features: int,
    widths: list[int],
    slots: int,
    max_rank: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    y = torch.randn(tokens, sum(widths), generator=g).to(dtype)
    a = (torch.randn(slots, len(widths), max_rank, in_features, generator=g) * 0.1).to(dtype)
    b = [(torch.randn(slots, max_rank, w, generator=g) * 0.1).to(dtype) for w in widths]
    ranks = torch.randint(0, max_rank + 1, (slots, len(widths)), generator=g, dtype=torch.int32)
    for s in range(slots):  # zero padding past each rank, as the slots hold it
        for p in range(len(widths)):
            a[s, p, int(ranks[s, p]) :] = 0
            b[p][s, int(ranks[s, p]) :] = 0
    token_slots = torch.randint(-1, slots, (tokens,), generator=g, dtype=torch.int32)
    if tokens > 1:
        token_slots[-1] = -1  # a base-model token among them
    return x, y, a, b, ranks, token_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "in_features", "widths"),
    [(1, 64, [64]), (5, 40, [24, 8, 8]), (19, 96, [48, 48]), (33, 576, [576, 192, 192])],
)
def test_matches_reference(dtype: torch.dtype, tokens: int, in_features: int, widths: list[int]) -> None:
    x, y, a, b, ranks, slots = problem(
        tokens=tokens, in_features=in_features, widths=widths, slots=3, max_rank=8, dtype=dtype, seed=tokens
    )
    offsets = [sum(widths[:p]) for p in range(len(widths))]
    expected = y.clone()
    b = [cpu_lora.blocked(t) for t in b]
    cpu_lora.lora_add_reference(x, expected, a, b, offsets, slots, ranks)
    cpu_lora.lora_add(x, y, a, b, offsets, slots, ranks)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    else:  # float sums in another order, then one bf16 rounding: at most one bf16 step apart
        torch.testing.assert_close(y.float(), expected.float(), rtol=8e-3, atol=8e-3)
    if tokens > 1:
        assert torch.equal(y[-1], expected[-1])


def test_base_tokens_untouched() -> None:
    x, y, a, b, ranks, _ = problem(
        tokens=6, in_features=32, widths=[32], slots=2, max_rank=4, dtype=torch.float32, seed=0
    )
    before = y.clone()
    b = [cpu_lora.blocked(t) for t in b]
    cpu_lora.lora_add(x, y, a, b, [0], torch.full((6,), -1, dtype=torch.int32), ranks)
    assert torch.equal(y, before)


def test_refusals_name_the_argument() -> None:
    x, y, a, b, ranks, slots = problem(
        tokens=4, in_features=32, widths=[16, 16], slots=2, max_rank=4, dtype=torch.float32, seed=1
    )
    b = [cpu_lora.blocked(t) for t in b]
    with pytest.raises(ValueError, match=r"slots must be in -1\.\.1"):
        cpu_lora.lora_add(x, y, a, b, [0, 16], torch.tensor([0, 2, 1, -1], dtype=torch.int32), ranks)
    with pytest.raises(ValueError, match="falls outside y"):
        cpu_lora.lora_add(x, y, a, b, [-4, 16], slots, ranks)
    with pytest.raises(ValueError, match=r"b\[0\] is torch\.bfloat16"):
        cpu_lora.lora_add(x, y, a, [b[0].bfloat16(), b[1]], [0, 16], slots, ranks)
    with pytest.raises(ValueError, match=r"ranks must be in 0\.\.4"):
        cpu_lora.lora_add(x, y, a, b, [0, 16], slots, ranks + 5)


@pytest.mark.parametrize(("tokens", "widths"), [(1, [64]), (11, [48, 16, 16]), (8, [40, 40])])
def test_shrink_by_input_pairs_matches_reference(tokens: int, widths: list[int]) -> None:
    """The bf16 shrink from A laid out by input pairs (each weight load feeding every token of a tile)."""
    x, y, a, b, ranks, slots = problem(
        tokens=tokens, in_features=96, widths=widths, slots=3, max_rank=8, dtype=torch.bfloat16, seed=tokens
    )
    offsets = [sum(widths[:p]) for p in range(len(widths))]
    b = [cpu_lora.blocked(t) for t in b]
    expected = y.clone()
    cpu_lora.lora_add_reference(x, expected, a, b, offsets, slots, ranks)
    cpu_lora.lora_add(x, y, a, b, offsets, slots, ranks, a_pairs=cpu_lora.by_input_pairs(a))
    torch.testing.assert_close(y.float(), expected.float(), rtol=8e-3, atol=8e-3)
