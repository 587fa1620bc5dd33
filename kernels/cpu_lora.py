"""Launcher of the segmented LoRA product (`csrc/cpu_lora.cpp`) and its reference.

`lora_add` adds, into a projection's output `y`, each token's own adapter product `B[s] (A[s] x)` (s: the token's
slot, -1 for none) for every part of the projection (q/k/v of a fused qkv...), reading only the first
`ranks[s, p]` rank rows of the zero-padded slots. It accumulates in float32 and rounds `y` once; on bf16 the
shrunk values `A[s] x` are rounded to bf16 before the expand (as a bf16 model's own LoRA product rounds them, and
where the CPU has AVX512-BF16 the kernel multiplies bf16 pairs). `lora_add_reference` does the same arithmetic
in torch, one token at a time.
"""

from __future__ import annotations

import torch
from structgen.kernels import cpu_build
from structgen.kernels._launch import check_dtype, check_shape
from structgen.kernels.cpu_ops import KERNEL_DTYPES, _kernel_message


def available() -> bool:
    return cpu_build.load()


def lora_add(
    x: torch.Tensor,  # [tokens, in]
    y: torch.Tensor,  # [tokens, out], updated in place
    a: torch.Tensor,  # [slots, parts, max_rank, in]
    b: list[torch.Tensor],  # per part [slots, ceil(width / 16), max_rank, 16]: `blocked(B)`
    offsets: list[int],  # each part's first column of y (the parts cover y's columns in order)
    slots: torch.Tensor,  # [tokens] int32, -1: the base model
    ranks: torch.Tensor,  # [slots, parts] int32, 0: the slot leaves the part alone
    a_pairs: torch.Tensor | None = None,
) -> None:
    """`a_pairs`: `by_input_pairs(a)`, the layout the BF16 path's faster shrink reads (optional)."""
    try:
        torch.ops.structgen_cpu.lora_add(x, y, a, b, offsets, slots, ranks, a_pairs)
    except RuntimeError as exc:
        _check(x, y, a, b, offsets, slots, ranks)
        if a_pairs is not None:
            check_dtype("lora_add", "a_pairs", a_pairs, (x.dtype,))
        raise ValueError(f"lora_add: {_kernel_message(exc)}") from None


def blocked(b: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of a part's B slots [slots, rank, width]: [slots, ceil(width / 16), rank, 16], each block
    of 16 columns with its rank rows side by side (zero past the width), so a block is one contiguous read."""
    slots, rank, width = b.shape
    padded = torch.nn.functional.pad(b, (0, -width % 16))
    return padded.view(slots, rank, -1, 16).transpose(1, 2).contiguous()


def by_input_pairs(a: torch.Tensor) -> torch.Tensor:
    """A's slots [slots, parts, rank, in] as [slots, in / 2, parts * rank, 2]: per pair of inputs, every rank
    column's two weights side by side (`in` must be even)."""
    slots, parts, rank, width = a.shape
    if width % 2:
        raise ValueError(f"by_input_pairs: the input width must be even, got {width}")
    return a.reshape(slots, parts * rank, width // 2, 2).transpose(1, 2).contiguous()


def unblocked(b: torch.Tensor, width: int) -> torch.Tensor:
    """`blocked`'s inverse: [slots, rank, width]."""
    slots, blocks, rank, _ = b.shape
    return b.transpose(1, 2).reshape(slots, rank, blocks * 16)[:, :, :width]


def _widths(offsets: list[int], y: torch.Tensor) -> list[int]:
    ends = [*offsets[1:], y.shape[1]]
    return [end - start for start, end in zip(offsets, ends, strict=True)]


def _check(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    offsets: list[int],
    slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    name = "lora_add"
    for what, t in (("x", x), ("y", y), ("a", a), *((f"b[{p}]", t) for p, t in enumerate(b))):
        check_dtype(name, what, t, KERNEL_DTYPES)
        if t.dtype != x.dtype:
            raise ValueError(f"{name}: {what} is {t.dtype}, x is {x.dtype}")
    check_shape(name, "x", x, (None, None))
    check_shape(name, "y", y, (x.shape[0], None))
    check_shape(name, "a", a, (None, None, None, x.shape[1]))
    num_slots, num_parts, max_rank, _ = a.shape
    if len(b) != num_parts or len(offsets) != num_parts:
        raise ValueError(f"{name}: {num_parts} parts in a, {len(b)} b tensors and {len(offsets)} offsets")
    for p, (bp, width) in enumerate(zip(b, _widths(offsets, y), strict=True)):
        if width <= 0 or offsets[p] < 0:
            raise ValueError(f"{name}: part {p} (columns {offsets[p]}..{offsets[p] + width}) falls outside y")
        check_shape(name, f"b[{p}]", bp, (num_slots, -(-width // 16), max_rank, 16))
    check_dtype(name, "slots", slots, (torch.int32,))
    check_shape(name, "slots", slots, (x.shape[0],))
    check_dtype(name, "ranks", ranks, (torch.int32,))
    check_shape(name, "ranks", ranks, (num_slots, num_parts))
    if len(slots) and not (int(slots.min()) >= -1 and int(slots.max()) < num_slots):
        raise ValueError(f"{name}: slots must be in -1..{num_slots - 1}")
    if ranks.numel() and not (int(ranks.min()) >= 0 and int(ranks.max()) <= max_rank):
        raise ValueError(f"{name}: ranks must be in 0..{max_rank}")


def lora_add_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    offsets: list[int],
    slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    plain = [unblocked(bp, width) for bp, width in zip(b, _widths(offsets, y), strict=True)]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for p, (bp, offset) in enumerate(zip(plain, offsets, strict=True)):
            rank = int(ranks[slot, p])
            if rank == 0:
                continue
            shrunk = a[slot, p, :rank].float() @ x[t].float()
            if x.dtype == torch.bfloat16:
                shrunk = shrunk.bfloat16().float()
            update = shrunk @ bp[slot, :rank].float()
            columns = y[t, offset : offset + bp.shape[2]]
            columns.copy_((columns.float() + update).to(y.dtype))
