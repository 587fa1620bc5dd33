"""Drawing again for sampled rows whose lazy pick the structured-output mask rejected (see `token_mask`).

A lazily masked row is first picked from its unmasked distribution p (the `InverseCdf` of its probabilities
exp(x / T - max), kept as `Draws`). When the mask rejects that pick:

1. `Draws.again`: draw from p again, up to `REDRAWS` times. Drawing from p until the token is in the allowed set
   A is rejection sampling: a row accepted on any draw got a token of p restricted to A, exactly. Each draw is
   two searches, cheap where A holds most of p's mass (a random token inside a JSON string).
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

# A rejected row draws again from its unmasked distribution up to this many times before it is drawn under its
# mask: at most a few cheap searches where the mask forbids little, and a quick fall-back to the mask at
# structural points where it allows only a few tokens.
REDRAWS = 3

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
        uniforms: Callable[[list[int]], Tensor],
    ) -> list[int]:
        """Draw the sampled rows of `rejected` again from p (up to `REDRAWS` times); returns the rows still
        rejected (and those not sampled: greedy rows), in order. `uniforms(rows)`: one U[0, 1) a row."""
        pending = rejected
        for _ in range(REDRAWS):
            again = [i for i in pending if i in self.position]
            if not again:
                break
            index = torch.tensor([self.position[i] for i in again], device=token_ids.device)
            picks = self.cdf.draw(uniforms(again), index)
            token_ids[again] = picks
            still = {i for i, good in zip(again, mask.allows(again, picks), strict=True) if not good}
            pending = [i for i in pending if i not in self.position or i in still]
        return pending

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
