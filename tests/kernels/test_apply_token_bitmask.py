"""apply_token_bitmask under the interpreter against its reference, and wired into the structured layer's
`apply_token_bitmask_` (the kernel path is taken for CUDA tensors only; here it is forced onto the interpreter)."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels.apply_token_bitmask import apply_token_bitmask, apply_token_bitmask_reference

from structgen.structured import bitmask as bitmask_module


def _inputs(batch: int, vocab: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (batch + 1, width), dtype=torch.int32, generator=gen)
    mask[0, 0] = -1  # bit 31 (the sign bit) set among others
    return logits, mask


@pytest.mark.parametrize(
    ("vocab", "width", "rows"),
    [
        (96, 3, None),  # a multiple of 32
        (100, 4, None),  # not a multiple of 32: the last word is partly used
        (130, 3, None),  # logits wider than the mask: columns 96.. are masked
        (77, 3, [2, 0]),  # only listed rows, in any order
        (5000, 157, [1]),  # several vocabulary blocks
    ],
)
def test_matches_reference(vocab: int, width: int, rows: list[int] | None) -> None:
    logits, mask = _inputs(3, vocab, width)
    expected = logits.clone()
    index = None if rows is None else torch.tensor(rows)
    apply_token_bitmask(logits, mask, index, block=64 if vocab < 1000 else 1024)
    apply_token_bitmask_reference(expected, mask, index)
    assert torch.equal(logits, expected)
    if rows is not None:  # unconstrained rows untouched
        fresh, _ = _inputs(3, vocab, width)
        for r in set(range(3)) - set(rows):
            assert torch.equal(logits[r], fresh[r])


def test_half_precision_logits() -> None:
    logits, mask = _inputs(2, 100, 4)
    half = logits.to(torch.bfloat16)
    apply_token_bitmask(half, mask)
    apply_token_bitmask_reference(logits, mask)
    assert torch.equal(half.float().isinf(), logits.isinf())


def test_bad_arguments_fail_clearly() -> None:
    logits, mask = _inputs(4, 64, 2)
    with pytest.raises(ValueError, match="bitmask has 3 rows for 4"):
        apply_token_bitmask(logits, mask[:3])
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(logits, mask.long())


def test_structured_layer_uses_the_kernel_for_device_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def kernel(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        calls.append(rows)
        apply_token_bitmask(logits, mask, rows)

    monkeypatch.setattr(bitmask_module, "_use_kernel", lambda logits: True)
    monkeypatch.setattr("structgen.kernels.apply_token_bitmask.apply_token_bitmask", kernel)
    logits, mask = _inputs(3, 100, 3)
    expected = logits.clone()
    bitmask_module.apply_token_bitmask_(logits, mask, [0, 2])
    apply_token_bitmask_reference(expected, mask, torch.tensor([0, 2]))
    assert torch.equal(logits, expected)
    assert len(calls) == 1
