"""Launcher of the sampler's inverse-CDF draw in native code (`csrc/cpu_inverse_cdf.cpp`).

The reference is the torch path of `structgen.engine.inverse_cdf.InverseCdf.draw`, which callers keep where the
library is not built; the tests compare the two token for token. One call replaces ~20 small tensor ops (~130-180
µs on a CPU, a cost that does not shrink with the rows drawn), so that drawing again for the few rows the
structured-output mask rejected costs microseconds.
"""

from __future__ import annotations

import torch
from structgen.kernels import cpu_build
from structgen.kernels.cpu_ops import _kernel_message

_NO_ROWS = torch.empty(0, dtype=torch.long)


def available() -> bool:
    """Whether the native ops can be used (builds them on the first call)."""
    return cpu_build.load()


def draw(
    probs: torch.Tensor,
    block_cum: torch.Tensor,
    uniforms: torch.Tensor,
    block: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id (int64) per uniform (float64 in [0, 1)): from row `rows[j]` of `probs` ([batch, vocab] float32,
    non-negative), or from row j when `rows` is None, by `block_cum` ([batch, ceil(vocab / block)] float64, the
    cumulative sums of each row's `block`-token blocks)."""
    try:
        return torch.ops.structgen_cpu.inverse_cdf_draw(
            probs, block_cum, uniforms, block, _NO_ROWS if rows is None else rows
        )
    except RuntimeError as exc:
        raise ValueError(f"inverse_cdf_draw: {_kernel_message(exc)}") from None
