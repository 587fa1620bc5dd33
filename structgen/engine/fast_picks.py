"""Picks that avoid full passes over a 100k vocabulary where a cheaper exact way exists.

- `row_argmax`: `argmax(dim=1)` by chunk maxima (CPU argmax is a slow scalar loop).
- `allowed_token_ids` + `pick_among`: a row whose structured-output mask allows only a few tokens (a structural
  point of a format: `{`, `":`, `,` or `}`) is picked among those tokens alone. Masking the row costs a pass that
  writes -inf over the whole vocabulary, then softmax and the CDF pass over it again, all to choose among a
  handful of entries; gathering their logits gives the same pick (greedy: the first maximum among the allowed
  tokens; sampled: the same distribution, p restricted to the allowed set).
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from structgen.engine.inverse_cdf import search

# A row is picked among its allowed tokens when the mask allows at most this many. Measured on one core over a
# 100k vocabulary: listing and picking among 1,024 allowed tokens ≈ 90 µs, 4,096 ≈ 160 µs, 8,192 ≈ 310 µs, while
# masking the row and drawing from it whole ≈ 300 µs (and a second draw over the batch). 4,096 takes in a JSON
# number's position (cl100k's 1-3 digit tokens alone are ~1,100), which 1,024 sent down the whole-row path.
SPARSE_LIMIT = 4096


def row_argmax(x: Tensor) -> Tensor:
    """`x.argmax(dim=1)`, same result (first maximum; NaN counts as the maximum), faster on CPU.

    CPU argmax over a 100k vocabulary is a slow scalar loop (≈ 10 ms for [64, 100352] on one core) while amax
    is vectorized (≈ 1.6 ms): take each chunk's max, the argmax of those (the first chunk holding the row's
    maximum, or its first NaN), then the argmax inside that one chunk (≈ 1.9 ms in all).
    """
    chunk = _argmax_chunk(x.shape[1])
    if x.device.type != "cpu" or chunk == 0 or not x.is_contiguous():
        return x.argmax(dim=1)
    chunks = x.view(x.shape[0], -1, chunk)
    best_chunk = chunks.amax(dim=2).argmax(dim=1)
    within = chunks[torch.arange(x.shape[0], device=x.device), best_chunk].argmax(dim=1)
    return best_chunk * chunk + within


@functools.cache
def _argmax_chunk(vocab: int) -> int:
    """The largest power of two in 64..2048 that divides `vocab` into at least 8 chunks; 0 if none does."""
    for chunk in (2048, 1024, 512, 256, 128, 64):
        if vocab % chunk == 0 and vocab // chunk >= 8:
            return chunk
    return 0


def allowed_token_ids(packed_row: np.ndarray, vocab: int, limit: int = SPARSE_LIMIT) -> Tensor | None:
    """The ids (ascending, below `vocab`) that one bitmask row allows, or None when there are more than `limit`.

    `packed_row` is the row's bytes (uint8, little-endian words: bit i of byte b is token 8b + i).
    """
    if np.count_nonzero(packed_row) > limit:  # every nonzero byte allows at least one token
        return None  # (counted first: listing a wide row's bytes costs ~10x more, for nothing)
    nonzero = np.flatnonzero(packed_row)
    bits = np.unpackbits(packed_row[nonzero][:, None], axis=1, bitorder="little").astype(bool)
    ids = (nonzero[:, None] * 8 + np.arange(8))[bits]
    if len(ids) > limit:
        return None
    return torch.from_numpy(ids[ids < vocab].astype(np.int64))


def list_allowed_rows(
    bitmask: Tensor, rows: list[int], vocab: int, *, limit: int = SPARSE_LIMIT
) -> list[Tensor | None]:
    """`allowed_token_ids` of each of `rows` of `bitmask` ([rows, words] int32 on the CPU): one native call
    where the kernels are built (`structgen.kernels.cpu_sparse_picks`), else row by row in numpy."""
    if not rows:
        return []
    native = _native()
    if native is not None and bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1:
        return native.list_allowed(bitmask, rows, vocab, limit)
    packed = bitmask.contiguous().numpy().view(np.uint8)
    return [allowed_token_ids(packed[row], vocab, limit) for row in rows]


def pick_among_allowed(
    x: Tensor,
    rows: list[int],
    ids: list[Tensor],
    temperatures: list[float],
    uniforms: Tensor,
    token_ids: Tensor,
    ok: Tensor,
) -> None:
    """Pick batch row `rows[j]` of `x` among its allowed `ids[j]` (ascending int64): the first maximum where
    `uniforms[j]` (float64) is NaN, else a draw by it (`pick_among_rows` on the logits divided by
    `temperatures[j]`). Writes each token (-1 where no allowed token is possible) into `token_ids[row]`, and
    whether one was into `ok[row]`. One native call for float32 CPU logits where the kernels are built; the
    torch path (`pick_among_allowed_reference`) gives the same picks otherwise."""
    if not rows:
        return
    native = _native() if x.dtype == torch.float32 and x.device.type == "cpu" else None
    if native is not None and x.stride(-1) == 1:
        native.pick_among_allowed(x, rows, ids, temperatures, uniforms, token_ids, ok)
    else:
        pick_among_allowed_reference(x, rows, ids, temperatures, uniforms, token_ids, ok)


def pick_among_allowed_reference(
    x: Tensor,
    rows: list[int],
    ids: list[Tensor],
    temperatures: list[float],
    uniforms: Tensor,
    token_ids: Tensor,
    ok: Tensor,
) -> None:
    """`pick_among_allowed` in torch: every row's allowed logits side by side, padded with -inf, one pick for
    all (`pick_among_rows`)."""
    counts = torch.tensor([len(row_ids) for row_ids in ids])
    flat = torch.cat(ids).to(x.device)
    which = torch.repeat_interleave(torch.arange(len(ids)), counts)
    starts = torch.cumsum(counts, 0) - counts
    values = torch.full((len(ids), max(int(counts.max()), 1)), float("-inf"), dtype=x.dtype)
    batch_rows = torch.tensor(rows)
    values[which, torch.arange(len(flat)) - starts[which]] = x[batch_rows[which], flat]
    if any(t != 1.0 for t in temperatures):
        values /= torch.tensor(temperatures, dtype=values.dtype).unsqueeze(1)
    drawn = not bool(torch.isnan(uniforms).all())
    index, possible = pick_among_rows(values, uniforms if drawn else None)
    chosen = flat[(starts + index).clamp_max(len(flat) - 1)] if len(flat) else index  # (nothing allowed)
    token_ids[batch_rows] = torch.where(possible, chosen, -1)
    ok[batch_rows] = possible


@functools.cache
def _native() -> ModuleType | None:
    """`structgen.kernels.cpu_sparse_picks` when the native kernels are built here (the first call may build
    them), else None."""
    from structgen.kernels import cpu_sparse_picks

    return cpu_sparse_picks if cpu_sparse_picks.available() else None


def pick_among(values: Tensor, *, uniform: Tensor | None = None) -> tuple[int, bool]:
    """Index into `values` (the allowed tokens' logits, temperature already applied) of the pick, and whether
    any of them was possible: the first maximum (greedy, no `uniform`), or a draw by `uniform` (a float64
    U[0, 1) scalar tensor)."""
    if values.numel() == 0:
        return 0, False
    if uniform is None:
        index = int(values.argmax())
        return index, bool(torch.isfinite(values[index]))
    top = values.max()
    if not bool(torch.isfinite(top)):  # nothing possible, or NaN / +inf among them
        return 0, False
    cum = (values.double() - float(top)).exp_().cumsum(0).unsqueeze(0)
    return int(search(cum, uniform.reshape(1, 1) * cum[:, -1:])), True


def pick_among_rows(values: Tensor, uniforms: Tensor | None) -> tuple[Tensor, Tensor]:
    """`pick_among` for several rows at once: `values` `[rows, k]` (each row's allowed tokens' logits,
    temperature applied, padded with -inf), `uniforms` float64 `[rows]` with NaN for greedy rows (None: all
    greedy). Returns (index into each row, whether the row had any possible token). Row by row the same
    picks as `pick_among`: the first maximum, or the same float64 cumulative sums searched by the same rule
    (padding adds no mass, so it is never picked)."""
    top = values.amax(dim=1)
    possible = torch.isfinite(top)
    index = values.argmax(dim=1)
    if uniforms is not None:
        drawn = ~torch.isnan(uniforms) & possible
        if bool(drawn.any()):
            part = values[drawn].double()
            cum = (part - top[drawn].double().unsqueeze(1)).exp_().cumsum(1)
            target = uniforms[drawn].unsqueeze(1) * cum[:, -1:]
            index[drawn] = search(cum, target).squeeze(1)
    return index, possible
