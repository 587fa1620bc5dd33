"""Logits of rows whose structured-output mask allows only a few tokens, computed for those tokens alone.

A constrained row at a structural point of its format (a digit, `true` / `false`, `,` or `]`, the first token of
an enum value) allows a handful of tokens, yet its logits cost a product with the whole lm_head: on SmolLM2 a
49,152 x 576 matrix a row, about a seventh of a 32-row decode step on the CPU (BENCHMARKS.md, issue 22), after
which the sampler picks among the few allowed tokens anyway (`fast_picks.pick_among`). Where such a row's mask
was filled during the forward (`StructuredLogitsProcessor.narrow_rows`), its logits here are its hidden state's
products with the allowed tokens' rows of the lm_head (one dot product each, read in place by the native
kernel `kernels/cpu_narrow_logits` where it is built), and -inf everywhere
else: the masked row the sampler would have picked from. The products are the same sums as the full lm_head's
(in float32, rounded to the weight's dtype as its output is), so the masked distribution is the same; a sum
in another order may differ in its last bit, as it may between batch sizes.

`narrow_logits` takes the lm_head itself (`ParallelLMHead`, one rank) and returns what `compute_logits` would,
float32 `[rows, vocab]`, with the narrow rows filled this way and the others through the lm_head's own product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

# A row is computed narrow when its mask allows at most this many tokens: that many dot products are a few
# percent of a full row (natively ~0.05 ms on SmolLM2, ~0.07 ms on cl100k's digit tokens; the torch reference's
# gather and product ~0.35 / ~0.7 ms on one core), plus its -inf fill; the structural
# points allow far fewer (`true`/`false`, `,` `]`, an enum's first tokens), a number's position on cl100k about
# 1,100 (its 1-3 digit tokens), so 2,048 takes those in too. Whether a row is narrow depends on its own mask
# alone, never on the rest of the batch: its logits (and so its draws) must be the same whatever it is batched
# with.
NARROW_LIMIT = 2048
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def supports_narrow_logits(lm_head: nn.Module | None) -> bool:
    """Whether `narrow_logits` applies to this lm_head: a plain weight on one rank, on the CPU (on a GPU the full
    product is cheap next to the wait it would take to know the narrow rows before it)."""
    weight = getattr(lm_head, "weight", None)
    return (
        weight is not None
        and getattr(lm_head, "tp_size", 1) == 1
        and weight.device.type == "cpu"
        and callable(getattr(lm_head, "compute_logits", None))
    )


def narrow_logits(lm_head: nn.Module, hidden: Tensor, narrow: dict[int, Tensor]) -> Tensor:
    """float32 logits `[n, vocab]` of `hidden` `[n, hidden_size]`: the rows in `narrow` ({row: allowed token ids,
    ascending}) hold their allowed tokens' logits and -inf elsewhere; the other rows the lm_head's full product."""
    weight: Tensor = lm_head.weight  # type: ignore[assignment]
    n, vocab = hidden.shape[0], weight.shape[0]
    rows = sorted(narrow)
    if hidden.dim() != 2 or not rows or rows[-1] >= n:
        raise ValueError(
            f"narrow rows {rows[:4]}... do not index hidden states of shape {list(hidden.shape)}"
        )
    # Each row written once: the dense rows' logits converted to float32 as they are copied in (a run of
    # neighbouring rows at a time), the narrow rows set to -inf and then their allowed tokens. (A -inf fill of
    # the whole output, then the dense rows converted and index-copied over it, moved ~3x the bytes: on `tiny`'s
    # 100k vocabulary that ate what 12 narrow rows of 32 saved.)
    out = torch.empty((n, vocab), dtype=torch.float32, device=hidden.device)
    dense = [row for row in range(n) if row not in narrow]
    if dense:
        index = torch.tensor(dense, dtype=torch.long, device=hidden.device)
        logits = lm_head.compute_logits(hidden.index_select(0, index))
        for start, stop, at in _runs(dense):
            out[start:stop].copy_(logits[at : at + stop - start])
    # Each narrow row's products summed on its own, in float32, rounded to the weight's dtype as the full
    # product's output is: a row's logits must not depend on where it sits in the batch, and a batched GEMM's do
    # (MKL's sgemm sums a row differently at another position), which would give two requests with the same
    # seed different draws. Natively where the kernels are built (reading the allowed weight rows in place),
    # else a gathered matrix-vector product a row.
    fill = _narrow_kernel(weight, hidden)
    fill(weight, hidden, rows, [narrow[row] for row in rows], out)
    return out


def _narrow_kernel(weight: Tensor, hidden: Tensor) -> Callable[..., None]:
    """`cpu_narrow_logits.narrow_logits_rows` where it applies (CPU, float32 or bfloat16, rows contiguous), else
    its torch reference."""
    from structgen.kernels import cpu_narrow_logits

    if (
        _native_built()
        and weight.device.type == "cpu"
        and weight.dtype in _NATIVE_DTYPES
        and hidden.dtype in _NATIVE_DTYPES
        and weight.stride(1) == 1
        and hidden.stride(1) == 1
    ):
        return cpu_narrow_logits.narrow_logits_rows
    return cpu_narrow_logits.narrow_logits_reference


@functools.cache
def _native_built() -> bool:
    """Whether the native kernels are built here (the first call may build them), asked once, not every step."""
    from structgen.kernels import cpu_narrow_logits

    return cpu_narrow_logits.available()


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(start, stop, index in `rows` of start) of each run of consecutive row numbers in ascending `rows`."""
    runs: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows):
        if runs and runs[-1][1] == row:
            start, _, at = runs[-1]
            runs[-1] = (start, row + 1, at)
        else:
            runs.append((row, row + 1, i))
    return runs
