"""Which constrained rows the sampler should mask before picking: a per-request guess from how its lazy picks
fared so far at the same kind of position.

The sampler picks a constrained row from its unmasked logits first and masks it only when the pick is not
allowed (`structgen.engine.token_mask`): free for a model that follows its format, and costly where it does
not (a rejected row is drawn again, then listed or masked and drawn once more). A hinted row skips the unmasked
pick and goes straight to the cheap pick among its few allowed tokens. Whether a pick will be rejected depends
on the model and on where the output stands: a real model writes the digits a number needs, a random one
almost never does, while both get most characters of a string right. So each request keeps, per kind of
position (the innermost JSON value open: inside a string, a number, between an object's or an array's members;
one kind for non-JSON grammars), a running rate of rejected lazy picks, and a row is hinted where that rate is
high. A hinted position's rate decays a little each time, so it is tried lazily again now and then: a model
that learns the format (or a position that changed nature) stops being hinted. The hint changes cost only,
never which token is drawn (see `token_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest lazy pick in the running rate; the rate above which a position is hinted; the factor a
# hinted position's rate is multiplied by each time (about five hinted picks before the next lazy try).
_WEIGHT = 0.3
_HINT_ABOVE = 0.5
_DECAY = 0.93


@dataclass(slots=True)
class PickHints:
    """One request's rejection rates by kind of position (`context`: any hashable; None for no JSON view)."""

    rates: dict[int | None, float] = field(default_factory=dict)

    def hinted(self, context: int | None) -> bool:
        """Whether a pick at this kind of position is expected to be rejected (mask first)."""
        return self.rates.get(context, 0.0) > _HINT_ABOVE

    def picked_lazily(self, context: int | None, *, rejected: bool) -> None:
        rate = self.rates.get(context, 0.0)
        self.rates[context] = rate + _WEIGHT * (float(rejected) - rate)

    def picked_hinted(self, context: int | None) -> None:
        self.rates[context] = self.rates.get(context, 0.0) * _DECAY
