"""`apply_token_bitmask`: set disallowed logits to -inf in place from a packed int32 bitmask.

Bit `i % 32` of word `i // 32` set means token `i` is allowed (the layout llguidance, xgrammar and outlines-core
write). Grid: (row, vocabulary block). With a row-index list only those rows are launched, so unconstrained rows
are never read nor written. Logit columns past the mask's `32 * width` tokens (a vocabulary padded beyond the
tokenizer's) are masked too: a mask never lets an unknown token through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from structgen.kernels._launch import (
    FLOAT_DTYPES,
    check_contiguous,
    check_device,
    check_dtype,
    check_shape,
)

DEFAULT_BLOCK = 4096


@triton.jit
def _bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    logits_stride,
    bitmask_stride,
    vocab_size,
    covered,  # min(vocab_size, 32 * bitmask width): columns the mask speaks for
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + row)
    row = row.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_mask = cols < covered
    words = tl.load(bitmask_ptr + row * bitmask_stride + cols // 32, mask=in_mask, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    forbidden = (cols < vocab_size) & ~(allowed & in_mask)
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=forbidden)


def apply_token_bitmask(
    logits: torch.Tensor,  # [batch, vocab] float, edited in place
    bitmask: torch.Tensor,  # [>= batch, width] int32 on the logits' device
    rows: torch.Tensor | None = None,  # [n] int32/int64 on the logits' device: only these rows
    *,
    block: int = DEFAULT_BLOCK,
) -> None:
    """Mask `logits[i]` with `bitmask[i]` for every row (or the rows listed in `rows`), in place.

    Row indices are not range-checked on the device (that would need a sync); the caller validates them.
    """
    name = "apply_token_bitmask"
    tensors = (logits, bitmask) if rows is None else (logits, bitmask, rows)
    check_device(name, *tensors)
    check_shape(name, "logits", logits, (None, None))
    check_shape(name, "bitmask", bitmask, (None, None))
    check_dtype(name, "logits", logits, FLOAT_DTYPES)
    check_dtype(name, "bitmask", bitmask, (torch.int32,))
    check_contiguous(name, "logits", logits, inner_dims=1)
    check_contiguous(name, "bitmask", bitmask, inner_dims=1)
    batch, vocab = logits.shape
    if rows is None and bitmask.shape[0] < batch:
        raise ValueError(f"{name}: bitmask has {bitmask.shape[0]} rows for {batch} logits rows")
    if rows is not None:
        check_shape(name, "rows", rows, (None,))
        check_dtype(name, "rows", rows, (torch.int32, torch.int64))
        check_contiguous(name, "rows", rows)
    num_rows = batch if rows is None else rows.numel()
    if num_rows == 0 or vocab == 0:
        return
    _bitmask_kernel[(num_rows, triton.cdiv(vocab, block))](
        logits,
        bitmask,
        bitmask if rows is None else rows,  # unused when HAS_ROWS is False
        logits.stride(0),
        bitmask.stride(0),
        vocab,
        min(vocab, 32 * bitmask.shape[1]),
        HAS_ROWS=rows is not None,
        BLOCK=block,
    )


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Pure torch, bit by bit: what the kernel must do."""
    vocab = logits.shape[1]
    tokens = torch.arange(vocab, device=logits.device)
    covered = tokens < 32 * bitmask.shape[1]
    selected = range(logits.shape[0]) if rows is None else rows.tolist()
    for row in selected:
        words = bitmask[row].long()[(tokens // 32).clamp(max=bitmask.shape[1] - 1)]
        allowed = covered & (((words >> (tokens % 32)) & 1) == 1)
        logits[row].masked_fill_(~allowed, float("-inf"))
