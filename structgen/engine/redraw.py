"""Drawing again for sampled rows whose lazy pick the structured-output mask rejected (see `token_mask`).

A lazily masked row is first picked from its unmasked distribution p (the `InverseCdf` of its probabilities
exp(x / T - max), kept as `Draws`). When the mask rejects that pick:

1. `Draws.again`: draw `CANDIDATES` more tokens from p at once (one native call for every rejected row) and take
   the first that A, the allowed set, holds. Drawing from p until the token is in A is rejection sampling: a row
   accepted on any draw got a token of p restricted to A, exactly. Each candidate is two searches and a check of
   one token (a few µs), cheap where A holds a fair share of p's mass (a random token inside a JSON string near
   its `maxLength`), where filling the row's mask walks the vocabulary (0.2-0.8 ms on `tiny`'s 100k tokens).
2. `Draws.under_mask`: a row still rejected (A holds little of p's mass, and more tokens than the sampler lists
   one by one) is drawn from p restricted to A directly: its kept probabilities times A's 0/1 mask, and a new
   CDF over them. Those are the masked logits' probabilities scaled by one factor (exp(max over A - max)), so the
   distribution is the one masking the logits and sampling again would give, without that second pass of
   max, subtract and exp over the vocabulary (on `tiny`'s 100k tokens ~0.2 ms a row, plus a row gather).
   Where A's mass is below `MIN_MASS` next to p's most likely token, its float32 probabilities would have lost
   the precision of the masked row's own, so that row is left to the caller to mask and pick from its logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from structgen.engine.inverse_cdf import InverseCdf
from structgen.engine.token_mask import TokenMask
from structgen.structured.bitmask import zero_disallowed_

# A rejected row draws this many candidates from its unmasked distribution before it is drawn under its mask.
# All are drawn in one call, and checked in order only until one is allowed: where A holds a tenth of p's mass
# the row is still rejected after all of them one time in 5 (0.9^16), against 3 in 4 with three draws, and each
# check costs ~4 µs against a fill's 200-800 µs; where A holds almost nothing (a structural point, whose fill is
# cheap) the sixteen checks cost about what the three rounds of draws they replace did.
CANDIDATES = 16

# The least mass (the unmasked row's likeliest token has 1) that the allowed tokens may hold for a row to be
# drawn from its kept probabilities: at 1e-6 a token ~1e-25 times less likely than the allowed ones' likeliest
# still has a normal float32 probability (below that, the masked row is picked from its logits).
MIN_MASS = 1e-6


@dataclass(slots=True)
class Draws:
    """The CDFs of a pick's sampled rows, kept so that a row the mask rejects can draw again cheaply."""

    cdf: InverseCdf
    position: dict[int, int]  # batch row -> row of `cdf`

    def again(
        self,
        rejected: list[int],
        token_ids: Tensor,
        mask: TokenMask,
        uniforms: Callable[[list[int], int], Tensor],
    ) -> list[int]:
        """Draw `CANDIDATES` tokens from p for each sampled row of `rejected` and give it the first its mask
        allows; returns the rows still rejected (and those not sampled: greedy rows), in order.
        `uniforms(rows, k)`: k U[0, 1) numbers a row, row after row."""
        again = [i for i in rejected if i in self.position]
        if not again:
            return rejected
        k = CANDIDATES
        index = torch.tensor([self.position[i] for i in again], device=self.cdf.probs.device)
        picks = self.cdf.draw(uniforms(again, k), index.repeat_interleave(k)).tolist()
        accepted: dict[int, int] = {}
        for j, row in enumerate(again):
            token = mask.first_allowed(row, picks[j * k : (j + 1) * k])
            if token is not None:
                accepted[row] = token
        if accepted:
            token_ids[list(accepted)] = torch.tensor(list(accepted.values()), device=token_ids.device)
        return [i for i in rejected if i not in self.position or (i not in accepted)]

    def under_mask(
        self,
        rows: list[int],
        token_ids: Tensor,
        ok: Tensor,
        mask: TokenMask,
        uniforms: Callable[[list[int]], Tensor],
    ) -> list[int]:
        """Draw the sampled rows of `rows` (their mask rows filled here if need be) from p restricted to the
        mask; returns the rows left for the caller to mask and pick from their logits: not sampled, or too
        little allowed mass."""
        drawn = [i for i in rows if i in self.position]
        if not drawn:
            return rows
        # The rows may not be filled yet: on the CPU the sampler's sparse split fills them first, but off it
        # (a GPU) nothing else has, and an unfilled row holds another step's or another request's bits.
        mask.ensure_filled(drawn)
        index = torch.tensor([self.position[i] for i in drawn], device=self.cdf.probs.device)
        probs = self.cdf.probs.index_select(0, index)
        zero_disallowed_(probs, mask.bitmask, drawn)
        restricted = InverseCdf(probs)
        usable = (restricted.ok & (restricted.block_cum[:, -1] >= MIN_MASS)).tolist()
        chosen = [j for j, good in enumerate(usable) if good]
        if chosen:
            batch_rows = [drawn[j] for j in chosen]
            at = torch.tensor(chosen, device=probs.device)
            token_ids[batch_rows] = restricted.draw(uniforms(batch_rows), at).to(token_ids.device)
            ok[batch_rows] = True
        left = {drawn[j] for j, good in enumerate(usable) if not good}
        return [i for i in rows if i not in self.position or i in left]
