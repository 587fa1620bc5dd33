"""Launchers of the sampler's structured-output fast path in native code (`csrc/cpu_sparse_picks.cpp`).

- `list_allowed`: the ids each listed bitmask row allows, or None for a row allowing more than `limit`;
- `pick_among_allowed`: each row picked among its few allowed tokens (the first maximum, or an inverse-CDF draw
  in float64), written straight into the sampler's `token_ids` and `ok`.

Their references are the torch/numpy paths of `structgen.engine.fast_picks` (`allowed_token_ids`,
`pick_among_rows`), which callers keep where the library is not built; the tests compare the two. Each call
replaces ~20 small tensor ops (~0.5-1 ms on a CPU) by one, taking Python lists where building tensors would
cost more than the work.
"""

from __future__ import annotations

import torch
from structgen.kernels import cpu_build
from structgen.kernels.cpu_ops import _kernel_message


def available() -> bool:
    """Whether the native ops can be used (builds them on the first call)."""
    return cpu_build.load()


def list_allowed(bitmask: torch.Tensor, rows: list[int], vocab: int, limit: int) -> list[torch.Tensor | None]:
    """For each of `rows` of `bitmask` ([rows, words] int32, bit b of word w = token 32w + b): its allowed ids
    below `vocab` (int64, ascending), or None when more than `limit` bits are set."""
    try:
        listed = torch.ops.structgen_cpu.list_allowed(bitmask, rows, vocab, limit)
    except RuntimeError as exc:
        raise ValueError(f"list_allowed: {_kernel_message(exc)}") from None
    return [None if ids.dim() == 2 else ids for ids in listed]


def pick_among_allowed(
    x: torch.Tensor,
    rows: list[int],
    ids: list[torch.Tensor],
    temperatures: list[float],
    uniforms: torch.Tensor,
    token_ids: torch.Tensor,
    ok: torch.Tensor,
) -> None:
    """Pick batch row `rows[j]` of `x` ([batch, vocab] float32) among its allowed `ids[j]`: the first maximum
    where `uniforms[j]` (float64) is NaN, else a draw by it from softmax(x[row, ids] / temperatures[j]). Writes
    the token (-1 when no allowed token is possible) into `token_ids[row]` and whether one was into `ok[row]`."""
    try:
        torch.ops.structgen_cpu.pick_among_allowed(x, rows, ids, temperatures, uniforms, token_ids, ok)
    except RuntimeError as exc:
        raise ValueError(f"pick_among_allowed: {_kernel_message(exc)}") from None
