"""The batch bitmask layout, `apply_token_bitmask_` and `zero_disallowed_`, against a per-token reference."""

from __future__ import annotations

import pytest
import torch

from structgen.structured.bitmask import (
    _apply_cpu,
    _apply_torch,
    _zero_torch,
    allocate_token_bitmask,
    allow_tokens,
    apply_token_bitmask_,
    bitmask_width,
    fill_allow_only,
    unpack_bitmask,
    zero_disallowed_,
)


def _reference(logits: torch.Tensor, allowed: list[set[int] | None]) -> torch.Tensor:
    out = logits.clone()
    for row, tokens in enumerate(allowed):
        if tokens is None:
            continue
        for t in range(out.shape[1]):
            if t not in tokens:
                out[row, t] = float("-inf")
    return out


def test_width_and_allocation() -> None:
    assert bitmask_width(100_288) == 3134
    assert bitmask_width(32) == 1 and bitmask_width(33) == 2
    mask = allocate_token_bitmask(4, 100_288)
    assert mask.shape == (4, 3134) and mask.dtype == torch.int32 and (mask == -1).all()
    with pytest.raises(ValueError, match="bad bitmask shape"):
        allocate_token_bitmask(2, 0)


@pytest.mark.parametrize("vocab", [70, 96, 100])
def test_apply_matches_reference_including_sign_bits(vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    allowed: list[set[int] | None] = [{0, 31, 32, 63}, {5, min(vocab, 96) - 1}, None, {31}]
    mask = allocate_token_bitmask(6, 96)  # more rows than the batch; 96 tokens of mask
    for row, tokens in enumerate(allowed):
        if tokens is not None:
            fill_allow_only(mask, row, sorted(tokens))
    out = logits.clone()
    apply_token_bitmask_(out, mask, rows=[0, 1, 3])
    expected = _reference(logits, allowed)
    if vocab > 96:  # columns past the mask's tokens are always masked
        expected[[0, 1, 3], 96:] = float("-inf")
    assert torch.equal(out, expected)


def test_rows_none_masks_every_row_and_unlisted_rows_are_untouched() -> None:
    logits = torch.zeros(3, 64)
    mask = allocate_token_bitmask(3, 64)
    fill_allow_only(mask, 0, [1])
    fill_allow_only(mask, 2, [2])
    a = logits.clone()
    apply_token_bitmask_(a, mask)
    assert torch.isinf(a[0]).sum() == 63 and torch.isinf(a[1]).sum() == 0 and torch.isinf(a[2]).sum() == 63
    b = logits.clone()
    apply_token_bitmask_(b, mask, rows=[2])
    assert torch.isinf(b[0]).sum() == 0 and torch.isinf(b[2]).sum() == 63
    c = logits.clone()
    apply_token_bitmask_(c, mask, rows=[])
    assert torch.equal(c, logits)


def test_allow_tokens_and_unpack_roundtrip() -> None:
    mask = torch.zeros(1, 3, dtype=torch.int32)
    allow_tokens(mask, 0, [0, 31, 40, 95])
    assert unpack_bitmask(mask[0], 96).nonzero().view(-1).tolist() == [0, 31, 40, 95]
    assert unpack_bitmask(mask[0], 100)[96:].sum() == 0  # beyond the mask: not allowed
    with pytest.raises(ValueError, match="outside a bitmask"):
        allow_tokens(mask, 0, [96])


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="2-D"):
        apply_token_bitmask_(torch.zeros(32), torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="out of range"):
        apply_token_bitmask_(torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.int32), rows=[2])
    with pytest.raises(ValueError, match="rows for"):
        apply_token_bitmask_(torch.zeros(3, 32), torch.zeros(2, 1, dtype=torch.int32))


def test_cpu_and_device_paths_agree() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 100, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=gen)
    a, b = logits.clone(), logits.clone()
    _apply_cpu(a, mask, [0, 2, 4], covered=100)
    _apply_torch(b, mask, torch.tensor([0, 2, 4]), covered=100)
    assert torch.equal(a, b)
    assert torch.equal(a[[1, 3]], logits[[1, 3]])
    full, bf16 = logits.clone(), logits.to(torch.bfloat16)
    apply_token_bitmask_(full, mask)
    apply_token_bitmask_(bf16, mask)  # half-precision logits are masked the same way
    assert torch.equal(torch.isinf(bf16), torch.isinf(full))


@pytest.mark.parametrize("vocab", [100, 128])
def test_zero_disallowed_zeroes_what_apply_masks_on_both_paths(vocab: int) -> None:
    gen = torch.Generator().manual_seed(2)
    mask = torch.randint(-(2**31), 2**31 - 1, (6, 4), dtype=torch.int32, generator=gen)  # 128 tokens of mask
    probs = torch.rand(3, vocab, generator=gen) + 0.5
    rows = [4, 0, 4]  # probs row j goes with mask row rows[j], repeats allowed
    reference = probs.log()
    apply_token_bitmask_(reference, mask.index_select(0, torch.tensor(rows)))
    cpu, other = probs.clone(), probs.clone()
    zero_disallowed_(cpu, mask, rows)
    _zero_torch(other, mask, rows, covered=min(vocab, 128))
    assert torch.equal(cpu, other)
    assert torch.equal(cpu == 0, torch.isinf(reference))  # zero exactly where apply sets -inf
    assert torch.equal(cpu[cpu != 0], probs[cpu != 0])  # allowed probabilities untouched
    with pytest.raises(ValueError, match="float32"):
        zero_disallowed_(probs.double(), mask, rows)
