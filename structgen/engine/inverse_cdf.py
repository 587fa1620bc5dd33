"""Drawing tokens from unnormalized probabilities by inverse CDF, with one uniform number per draw.

The CDF is searched in two levels, over block sums and then within the chosen block, both cumulated in
float64 but on small tensors ([B, V / block] and [B, block]): a float64 cumsum of the whole [64, 100k] costs
~180 ms on two CPU cores. With one float32 cumsum (and a float32 uniform), tokens less likely than float32's
6e-8 steps near 1.0 would be drawn at quantised rates, or never where the cumsum accumulates in float32 (CUDA).

The block sums are kept (`InverseCdf`), so drawing again from the same rows costs only the two searches and a
gather of one block per row: the sampler redraws this way when the structured-output mask rejects a pick. On
the CPU one native call does the draw (`structgen.kernels.cpu_inverse_cdf`, where the kernels are built): the
torch path below is ~20 small ops, ~130-180 µs a call however few rows it draws, and a structured step draws
several times (redraws after rejected picks, draws under the mask); the native call gives the same tokens.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

CDF_BLOCK = 1024


class InverseCdf:
    """The block-level CDF of each row of `probs` (`[B, V]`, non-negative, need not sum to 1)."""

    def __init__(self, probs: Tensor) -> None:
        batch, vocab = probs.shape
        block = min(vocab, CDF_BLOCK)
        num_blocks = -(-vocab // block)
        full = vocab // block
        # Block sums without padding the whole [B, V] (a copy that costs as much as the draw): the full blocks
        # are a view, the short last block is summed on its own.
        sums = probs.new_empty(batch, num_blocks)
        sums[:, :full] = probs[:, : full * block].view(batch, full, block).sum(dim=2)
        if full < num_blocks:
            sums[:, full] = probs[:, full * block :].sum(dim=1)
        self.probs = probs
        self.block = block
        self.block_cum = sums.double().cumsum(dim=1)
        total = self.block_cum[:, -1]
        # Rows with no mass at all (everything impossible, or NaN / +inf logits) cannot be drawn from.
        self.ok = torch.isfinite(total) & (total > 0)

    def draw(self, uniforms: Tensor, rows: Tensor | None = None) -> Tensor:
        """One token id per uniform in [0, 1): from every row, or from rows `rows` (a long tensor) only."""
        probs = self.probs
        if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.stride(-1) == 1:
            native = _native()
            if native is not None:
                return native.draw(
                    probs,
                    self.block_cum,
                    uniforms.to(torch.float64).contiguous(),
                    self.block,
                    None if rows is None else rows.to(torch.long).contiguous(),
                )
        return self.draw_reference(uniforms, rows)

    def draw_reference(self, uniforms: Tensor, rows: Tensor | None = None) -> Tensor:
        """`draw` in torch ops (any device): the reference the native draw is tested against."""
        probs, block, vocab = self.probs, self.block, self.probs.shape[1]
        block_cum = self.block_cum if rows is None else self.block_cum.index_select(0, rows)
        num_blocks = block_cum.shape[1]
        target = uniforms.double().unsqueeze(1) * block_cum[:, -1:]
        chosen_block = search(block_cum, target).clamp_max(num_blocks - 1)
        before = block_cum.gather(1, (chosen_block - 1).clamp_min(0)).masked_fill_(chosen_block == 0, 0.0)
        columns = chosen_block * block + torch.arange(block, device=probs.device)
        inside = columns.clamp_max(vocab - 1)
        # Only the chosen block of each row is read (not whole rows), also when drawing from a subset.
        inner = probs.gather(1, inside) if rows is None else probs[rows.unsqueeze(1), inside]
        inner = inner.masked_fill_(columns >= vocab, 0.0)
        inner_cum = inner.double().cumsum(dim=1)
        # Where the target falls within the block, as a fraction of the block's float32-summed mass, placed on
        # the block's exact float64 cumsum: the float32 sum of a block near 1.0 is off by a few of its ulps.
        block_mass = block_cum.gather(1, chosen_block) - before
        fraction = ((target - before) / block_mass).clamp_(0.0, 1.0)
        position = search(inner_cum, fraction * inner_cum[:, -1:]).clamp_max(block - 1)
        return (chosen_block * block + position).squeeze(1).clamp_max(vocab - 1)


@functools.cache
def _native() -> ModuleType | None:
    """`structgen.kernels.cpu_inverse_cdf` when the native kernels are built here (the first call may build
    them), else None."""
    from structgen.kernels import cpu_inverse_cdf

    return cpu_inverse_cdf if cpu_inverse_cdf.available() else None


def search(cum: Tensor, target: Tensor) -> Tensor:
    """First index whose cumulative mass exceeds `target` (`[rows, 1]`), never past the last with mass.

    `right=True` skips zero-probability entries (their cumulative value equals the one before them); the
    clamp catches a target that rounding put at or past the row's total.
    """
    found = torch.searchsorted(cum, target, right=True)
    last = torch.searchsorted(cum, cum[:, -1:].contiguous(), right=False)
    return torch.minimum(found, last)
