"""The batch token bitmask: one int32 row per sequence, 32 tokens a word (bit `i % 32` of word `i // 32` set
means token `i` is allowed), covering the model's padded vocabulary. This is the layout llguidance,
xgrammar and outlines-core all write, so backends fill rows in place without conversion.

`apply_token_bitmask_` masks CPU logits with a byte-table lookup and CUDA logits with the Triton kernel
`structgen.kernels.apply_token_bitmask`; `zero_disallowed_` does the same to probabilities (0 instead of -inf).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask of `batch_size` rows with every token allowed; backends overwrite the rows they own.

    `pin_memory` speeds the host→GPU copy of each step's mask when logits live on a GPU.
    """
    if batch_size < 0 or vocab_size <= 0:
        raise ValueError(f"bad bitmask shape: batch_size={batch_size}, vocab_size={vocab_size}")
    mask = torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)
    return mask.pin_memory() if pin_memory else mask


def fill_allow_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Overwrite `row` so that exactly `token_ids` are allowed (used once a grammar has ended: EOS only)."""
    bitmask[row].zero_()
    allow_tokens(bitmask, row, token_ids)


def allow_tokens(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Set the bits of `token_ids` in `row`, leaving the others as they are."""
    words = bitmask.shape[1]
    for t in token_ids:
        word, bit = divmod(int(t), 32)
        if word >= words:
            raise ValueError(f"token id {t} lies outside a bitmask of {words * 32} tokens")
        # Bit 31 is the int32 sign bit: build the word with Python ints and wrap to two's complement.
        value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def unpack_bitmask(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool tensor `[vocab_size]`: which tokens one bitmask row allows (tests, debugging, jump-forward)."""
    bits = (bitmask_row.unsqueeze(-1) >> _shifts(bitmask_row.device)) & 1
    allowed = bits.reshape(-1).bool()
    if allowed.numel() < vocab_size:
        allowed = torch.cat([allowed, allowed.new_zeros(vocab_size - allowed.numel())])
    return allowed[:vocab_size]


def apply_token_bitmask_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: Sequence[int] | torch.Tensor | None = None,
) -> None:
    """Set to -inf, in place, every logit whose bit is 0; allowed logits keep their values.

    `bitmask[i]` is the mask of `logits[i]` (the bitmask may have more rows than the batch). `rows` limits
    the work to the constrained rows; the others are left untouched and cost nothing. Logit columns beyond
    the bitmask's `32 * width` tokens are masked too: a mask never lets an unknown token through.
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(
            f"logits and bitmask must be 2-D, got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    batch, vocab = logits.shape
    if rows is None:
        if bitmask.shape[0] < batch:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {batch} logits rows")
        index = None
    else:
        # Checked on the host, before the index goes to the logits' device (a check there would wait on it).
        index = torch.as_tensor(rows, dtype=torch.long, device="cpu")
        if index.numel() == 0:
            return
        if int(index.max()) >= min(batch, bitmask.shape[0]) or int(index.min()) < 0:
            raise ValueError(
                f"rows {index.tolist()} out of range for {batch} logits / {bitmask.shape[0]} mask rows"
            )
        index = index.to(logits.device)
    if _use_kernel(logits):
        from structgen.kernels.apply_token_bitmask import apply_token_bitmask

        # The kernel masks columns past the bitmask itself; the mask is indexed by logits row on the device,
        # so only the batch's rows travel (the engine's bitmask holds twice the rows it needs).
        apply_token_bitmask(logits, bitmask[:batch].to(logits.device, non_blocking=True), index)
        return
    covered = min(vocab, bitmask.shape[1] * 32)
    if logits.device.type == "cpu" and bitmask.device.type == "cpu":
        _apply_cpu(logits, bitmask, list(range(batch)) if index is None else index.tolist(), covered)
    else:
        _apply_torch(logits, bitmask, index, covered)
    if covered < vocab:
        logits[slice(None) if index is None else index, covered:] = float("-inf")


# Byte value -> the 8 additive biases of its bits (0: allowed, -inf: forbidden), bit 0 first.
_BYTE_BIAS = np.where(
    (np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(0.0), np.float32(-np.inf)
).astype(np.float32)


# Byte value -> the 8 factors of its bits (1: allowed, 0: forbidden), for probabilities.
_BYTE_KEEP = (_BYTE_BIAS == 0).astype(np.float32)


def _expanded_rows(
    bitmask: torch.Tensor, rows: Iterable[int], table: np.ndarray, covered: int
) -> Iterator[torch.Tensor]:
    """Each of `rows` expanded by `table` (byte value -> its 8 bits' values) over the first `covered` tokens.
    One row at a time into one cache-sized buffer (each yielded tensor is overwritten by the next): about 10x
    faster than unpacking with shifts on a 100k vocabulary. Bytes in little-endian order are the bitmask's
    token order (bit i of word w is token 32w + i)."""
    packed = bitmask.contiguous().numpy().view(np.uint8)
    expanded = np.empty((packed.shape[1], 8), dtype=np.float32)
    values = torch.from_numpy(expanded.reshape(-1)[:covered])
    for row in rows:
        np.take(table, packed[row], axis=0, out=expanded)
        yield values


def _unpacked_rows(
    bitmask: torch.Tensor, index: torch.Tensor, device: torch.device, covered: int
) -> torch.Tensor:
    """Bits (0/1, int32) `[len(index), covered]` of bitmask rows `index`, on `device`: unpacked with shifts (off
    the CPU)."""
    masks = bitmask.index_select(0, index.to(bitmask.device)).to(device, non_blocking=True)
    bits = (masks.unsqueeze(-1) >> _shifts(masks.device)) & 1
    return bits.reshape(masks.shape[0], -1)[:, :covered]


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], covered: int) -> None:
    # The rows' 0/-inf biases, added in place.
    for row, bias in zip(rows, _expanded_rows(bitmask, rows, _BYTE_BIAS, covered), strict=True):
        logits[row, :covered].add_(bias)


def zero_disallowed_(probs: torch.Tensor, bitmask: torch.Tensor, mask_rows: Sequence[int]) -> None:
    """Set to 0, in place, every probability whose bit is 0: `probs[j]` (float32) under `bitmask[mask_rows[j]]`.

    The multiplicative twin of `apply_token_bitmask_`, for unnormalized probabilities already computed (a row
    drawn again under its mask, `structgen.engine.redraw`). Columns beyond the bitmask's tokens are zeroed.
    """
    if probs.dim() != 2 or probs.shape[0] != len(mask_rows) or probs.dtype != torch.float32:
        raise ValueError(
            f"probs must be float32 [{len(mask_rows)}, vocab], got {probs.dtype} {list(probs.shape)}"
        )
    covered = min(probs.shape[1], bitmask.shape[1] * 32)
    if probs.device.type == "cpu" and bitmask.device.type == "cpu":
        for j, keep in enumerate(_expanded_rows(bitmask, mask_rows, _BYTE_KEEP, covered)):
            probs[j, :covered].mul_(keep)
    else:
        _zero_torch(probs, bitmask, mask_rows, covered)
    if covered < probs.shape[1]:
        probs[:, covered:] = 0.0


def _zero_torch(probs: torch.Tensor, bitmask: torch.Tensor, mask_rows: Sequence[int], covered: int) -> None:
    index = torch.as_tensor(list(mask_rows), dtype=torch.long)
    probs[:, :covered].mul_(_unpacked_rows(bitmask, index, probs.device, covered).to(probs.dtype))


def _use_kernel(logits: torch.Tensor) -> bool:
    """CUDA logits go through the Triton kernel (one launch, no unpacked mask); CPU keeps the table lookup."""
    return logits.is_cuda and importlib.util.find_spec("triton") is not None


def _apply_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor | None, covered: int
) -> None:
    # Devices other than CPU and CUDA (or CUDA without Triton): unpack with shifts, then masked_fill.
    rows = torch.arange(logits.shape[0]) if index is None else index
    forbidden = _unpacked_rows(bitmask, rows, logits.device, covered) == 0
    target = logits if index is None else logits.index_select(0, index)
    target[:, :covered].masked_fill_(forbidden, float("-inf"))
    if index is not None:
        logits.index_copy_(0, index, target)


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS_CACHE.get(device)
    if shifts is None:
        shifts = _SHIFTS_CACHE[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts
