"""Launcher of the narrow rows' logits in native code (`csrc/cpu_narrow_logits.cpp`).

`narrow_logits_rows` writes, for each listed row, -inf over the whole row and then each allowed token's product
of its lm_head row with the row's hidden state (float32 sums, rounded to the weight's dtype). Its reference is
`narrow_logits_reference` below, the torch path `structgen.engine.narrow_logits` keeps where the library is not
built: a gather of the allowed weight rows, converted to float32, and a matrix-vector product a row, which on
`tiny`'s 100k vocabulary cost ~130 µs a row of ~2k digit tokens against a few here. The sums run in another
order than the reference's (the tests compare at float32 rounding, then the weight's).
"""

from __future__ import annotations

import torch
from structgen.kernels import cpu_build
from structgen.kernels.cpu_ops import _kernel_message


def available() -> bool:
    """Whether the native ops can be used (builds them on the first call)."""
    return cpu_build.load()


def narrow_logits_rows(
    weight: torch.Tensor, hidden: torch.Tensor, rows: list[int], ids: list[torch.Tensor], out: torch.Tensor
) -> None:
    """For each j: `out[rows[j]]` = -inf except at `ids[j]` (int64), which get `weight[id] . hidden[rows[j]]`.
    `weight` [vocab, size] and `hidden` [batch, size] float32 or bfloat16; `out` [batch, vocab] float32."""
    try:
        torch.ops.structgen_cpu.narrow_logits_rows(weight, hidden, rows, ids, out)
    except RuntimeError as exc:
        raise ValueError(f"narrow_logits_rows: {_kernel_message(exc)}") from None


def narrow_logits_reference(
    weight: torch.Tensor, hidden: torch.Tensor, rows: list[int], ids: list[torch.Tensor], out: torch.Tensor
) -> None:
    """`narrow_logits_rows` with torch ops, row by row: a matrix-vector product each, in float32, rounded to the
    weight's dtype as the full product's output is (a batched GEMM would sum a row differently at another
    position in the batch, and a row's logits must not depend on its neighbours)."""
    for row, allowed in zip(rows, ids, strict=True):
        products = torch.mv(weight.index_select(0, allowed).float(), hidden[row].float())
        out[row].fill_(float("-inf"))
        out[row, allowed] = products.to(weight.dtype).float()
