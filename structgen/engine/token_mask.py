"""A step's structured-output mask, handed to the sampler instead of being applied to the logits up front.

Applying a bitmask costs a pass over each constrained row's whole vocabulary (≈ 0.1 ms a row on a 100k
vocabulary on CPU), while a model that follows its format mostly picks an allowed token anyway. So the sampler
first picks from the unmasked logits and checks the one bit of the picked token; only rows whose pick is not
allowed are masked and picked again. That is exact, not an approximation:

- greedy: the argmax over all tokens, when allowed, is the argmax over the allowed ones;
- sampling without truncation: drawing from p until the draw falls in the allowed set A is rejection
  sampling, whose accepted draw follows `p(a) / p(A)` — the masked distribution. The sampler keeps each row's
  CDF, so a draw again costs two small searches; after a few rejected draws (A holds little of p: a structural
  point) it masks the row and draws from p restricted to A, which is the same distribution, so every path
  gives exactly the masked distribution.

Rows that use top-k / top-p / min-p (their truncation depends on the masked distribution) or that return
logprobs (which must be those of the masked distribution) are masked before sampling. The `eager` rows, the
caller's guess of where a pick will be rejected (a row rejected at the last step is likely at a structural
point again), skip the unmasked pick: a row whose mask allows few tokens is picked among those alone, one
whose mask turns out wide open goes the lazy way after all. The hint changes only cost, never the
distribution.

Checking a pick needs one bit, not the whole row: rows listed in `unfilled` are checked against their
grammar (a few µs) and their bitmask row is filled only when the sampler needs it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from structgen.sampling_params import SamplingParams


def needs_masked_distribution(params: SamplingParams) -> bool:
    """Rows whose result depends on the masked distribution as a whole, not only on which token wins."""
    if params.logprobs is not None:
        return True
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0)


@dataclass(slots=True)
class TokenMask:
    """`bitmask[i]` (int32, 32 tokens a word, bit set = allowed) is the mask of batch row i; `rows` lists the
    batch rows that are constrained (the others are never touched)."""

    bitmask: torch.Tensor
    rows: list[int]
    # Rows to pick with the mask straight away (a hint, see above). The sampler records in `rejected` the rows
    # to hint at the next step: lazy rows whose pick stayed rejected after drawing again, and hinted rows whose
    # mask allowed only a few tokens (still at a structural point).
    eager: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    # Rows whose bitmask row is not filled (yet), each with a check of one token against its grammar: a lazy
    # pick needs only that, and filling a row costs a walk over the whole vocabulary. `fill` fills such rows
    # when the whole row is needed (to mask it, or to list its few allowed tokens).
    unfilled: dict[int, Callable[[int], bool]] = field(default_factory=dict)
    fill: Callable[[list[int]], None] | None = None
    # Rows whose allowed tokens are already listed (ascending ids; the narrow rows, whose logits were computed
    # for those tokens alone: `structgen.engine.narrow_logits`), so the sampler need not list them again.
    allowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def allows(self, rows: list[int], token_ids: torch.Tensor) -> list[bool]:
        """Whether each `token_ids[j]` is allowed in batch row `rows[j]`: one bit read (or check) per row."""
        tokens = token_ids.to("cpu", torch.long).tolist()
        words = self.bitmask.shape[1]
        allowed = [False] * len(rows)
        read = []  # positions whose row is filled: read their bits in one go
        for j, (row, token) in enumerate(zip(rows, tokens, strict=True)):
            check = self.unfilled.get(row)
            if check is None:
                read.append(j)
            elif token < words * 32:  # a token beyond the mask is never allowed
                allowed[j] = check(token)
        if read:
            read_bits = _bits_on_cpu if self.bitmask.device.type == "cpu" else _bits_by_tensor_ops
            found = read_bits(self.bitmask, [rows[j] for j in read], [tokens[j] for j in read])
            for j, good in zip(read, found, strict=True):
                allowed[j] = good
        return allowed

    def first_allowed(self, row: int, tokens: list[int]) -> int | None:
        """The first of `tokens` that batch row `row` allows (checked in order, stopping there), or None."""
        words = self.bitmask.shape[1]
        check = self.unfilled.get(row)
        if check is not None:
            return next((token for token in tokens if 0 <= token < words * 32 and check(token)), None)
        read_bits = _bits_on_cpu if self.bitmask.device.type == "cpu" else _bits_by_tensor_ops
        found = read_bits(self.bitmask, [row] * len(tokens), tokens)
        return next((token for token, good in zip(tokens, found, strict=True) if good), None)

    def ensure_filled(self, rows: list[int]) -> None:
        """Fill the bitmask rows of `rows` that are not filled yet."""
        missing = [row for row in rows if row in self.unfilled]
        if missing:
            assert self.fill is not None, "unfilled rows need a fill"
            self.fill(missing)
            for row in missing:
                del self.unfilled[row]

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Set the disallowed logits of `rows` to -inf, in place."""
        from structgen.structured.bitmask import apply_token_bitmask_

        if rows:
            self.ensure_filled(rows)
            apply_token_bitmask_(logits, self.bitmask, rows=rows)

    def subset(self, keep: list[int]) -> TokenMask:
        """The mask of the batch made of rows `keep` of this one (in that order)."""
        self.ensure_filled(keep)  # the copy below must be complete
        position = {row: j for j, row in enumerate(keep)}
        index = torch.tensor(keep, dtype=torch.long, device=self.bitmask.device)
        return TokenMask(
            bitmask=self.bitmask.index_select(0, index),
            rows=[position[r] for r in self.rows if r in position],
            eager=[position[r] for r in self.eager if r in position],
            allowed={position[r]: ids for r, ids in self.allowed.items() if r in position},
        )


def _bits_on_cpu(bitmask: torch.Tensor, rows: list[int], tokens: list[int]) -> list[bool]:
    """Bit `tokens[j]` of bitmask row `rows[j]` (False past the mask's width), through a numpy view: ~1 µs a
    row, where the tensor ops of `_bits_by_tensor_ops` cost ~50-100 µs a call, and the sampler reads bits after
    every draw again for the rows the mask rejected."""
    words = bitmask.shape[1]
    view = bitmask.numpy()
    return [
        0 <= (token >> 5) < words and (int(view[row, token >> 5]) >> (token & 31)) & 1 == 1
        for row, token in zip(rows, tokens, strict=True)
    ]


def _bits_by_tensor_ops(bitmask: torch.Tensor, rows: list[int], tokens: list[int]) -> list[bool]:
    """`_bits_on_cpu` for a bitmask on any device: one gather of the words, shifted and masked on the CPU."""
    words = bitmask.shape[1]
    device = bitmask.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    picked = torch.tensor(tokens, dtype=torch.long)
    word = picked >> 5
    bits = bitmask[index, word.clamp(0, words - 1).to(device)].cpu()
    inside = (word >= 0) & (word < words)
    return (((bits >> (picked & 31)) & 1).bool() & inside).tolist()
