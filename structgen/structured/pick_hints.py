"""Which constrained rows the sampler should mask before picking: a guess from how lazy picks fared so far at
the same kind of position, learnt by every request of one compiled spec.

The sampler picks a constrained row from its unmasked logits first and masks it only when the pick is not
allowed (`structgen.engine.token_mask`): free for a model that follows its format, and costly where it does
not (a rejected row is drawn again, then listed or masked and drawn once more). A hinted row skips the unmasked
pick and goes straight to the cheap pick among its few allowed tokens. Whether a pick will be rejected depends
on the model and on where the output stands: a real model writes the digits a number needs, a random one
almost never does, while both get most characters of a string right. So each compiled spec keeps
(`CompiledSpec.pick_hints`, shared by its requests: a new output starts with what the ones before it learnt), per
kind of position (`StructuredRequest.hint_context`: the member being written, by the keys of the open objects,
and within it: inside a number; inside a string, with or without its next bytes forced; between values, by the
object or array open and the last byte written, `:` before a value, `,` after one; one kind for non-JSON
grammars), a running rate of rejected lazy picks, and a row is hinted where that rate is high. A hinted
position's rate decays a little each time, so it is tried lazily again now and then: a model that learns the
format (or a position that changed nature) stops being hinted. The hint changes cost only,
never which token is drawn (see `token_mask`).

The same table also keeps, per kind of position, how often the mask there was narrow (a few allowed tokens:
a digit, `true`/`false`, `,` or `]`), measured on rows whose mask was filled. A row expected narrow is filled
on the mask thread during the forward, so that its logits can be computed for its allowed tokens alone
(`structgen.engine.narrow_logits`); a position found wide is left unfilled, and tried again now and then; a
position in doubt (found wide lately, or narrow only sometimes) is tried on one row a step, not on every row of
the batch that stands there. Rates move per row, and a batch feeds many rows a step into one table: the retries
are spaced in rows accordingly. A request's own table (a seeded request's: `StructuredRequest.share_hints`) meets
each member afresh, so there the first measure of a kind of position decides it (one wide fill to learn that a
name is wide, not four), where a compile's table, fed by a whole batch, averages from the start.

Open text (a value's string that takes free text, where the grammar does not force the next bytes) is never
filled ahead for its width: its mask allows every content token that fits the room left (tens of thousands;
narrow only a character or two before a `maxLength`), filling it walks the vocabulary (~0.3 ms a row on
SmolLM2's, 0.5-1.2 ms on cl100k's), and a narrow row saves ~40 us (its share of the lm_head and of the pick). A
request's own table tried each member's strings afresh and again every ~30 rows: on `optional_anyof`
(BENCHMARKS.md, issue 22) those tries were ~60% of SmolLM2's mask fills. Such rows are picked lazily; one whose
pick is rejected is filled then. Nor is such a row hinted where its lazy picks keep being rejected (a random
model's, writing past a `maxLength` or into a quote): masking it first needs that fill up front, its allowed
tokens are too many to pick among cheaply, and the sixteen candidates a rejected pick draws again mostly find
an allowed one: on `tiny`'s `optional_anyof` ~130 such rows in 150 steps were filled ahead (~650 us each);
not hinted, ~25 more rows than before needed a fill (after their candidates), the others none. Whether a kind of
position is open text is told once (`StructuredRequest.hint_context` asks the grammar about a few letters): an
enum's string, a date's digits, a key, stay narrow candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest lazy pick in the running rate; the rate above which a position is hinted; the factor a
# hinted position's rate is multiplied by each time (one request's: about five hinted picks before the next lazy
# try; a compile's, fed by a whole batch: about fifteen rows).
_WEIGHT = 0.3
_HINT_ABOVE = 0.5
_DECAY = 0.93
_SHARED_DECAY = 0.97
# The narrow rate's weight of the newest filled row, the rate from which a row is filled ahead, and how far an
# unfilled position's rate climbs back each row left unfilled (one request's: a wide position filled again after
# about ten steps; a compile's: after ~90 rows).
_NARROW_WEIGHT = 0.3
_NARROW_ABOVE = 0.3
_NARROW_RETRY = 0.01
_SHARED_NARROW_RETRY = 0.001
# Below this rate a position is in doubt (tried again after being found wide, or sometimes narrow, sometimes
# not): one row a step is filled ahead to find out, not every row of the batch at that position.
_NARROW_SURE = 0.6


@dataclass(slots=True)
class PickHints:
    """The rejection and narrow rates of one compiled spec's requests by kind of position (`context`: any
    hashable; None for no JSON view)."""

    rates: dict[int | None, float] = field(default_factory=dict)
    narrow: dict[int | None, float] = field(default_factory=dict)  # by kind of position; 1.0 until measured
    decay: float = _DECAY
    narrow_retry: float = _NARROW_RETRY
    first_decides: bool = False  # a kind of position's first measured width sets its narrow rate outright
    # By kind of position inside a string: whether it is open text (see above), told once (`saw_text`).
    text: dict[int | None, bool] = field(default_factory=dict)

    @classmethod
    def private(cls) -> PickHints:
        """A table for one request alone (and its samples': `copy`): it meets each member once per output, so
        its first look at a kind of position decides."""
        return cls(first_decides=True)

    def copy(self) -> PickHints:
        """An independent table starting from what this one learnt (a seeded request's sibling sample)."""
        return PickHints(
            dict(self.rates),
            dict(self.narrow),
            self.decay,
            self.narrow_retry,
            self.first_decides,
            dict(self.text),
        )

    @classmethod
    def shared(cls) -> PickHints:
        """A table for every request of one compile (`CompiledSpec.pick_hints`): retries spaced for a batch."""
        return cls(decay=_SHARED_DECAY, narrow_retry=_SHARED_NARROW_RETRY)

    def hinted(self, context: int | None) -> bool:
        """Whether a pick at this kind of position is expected to be rejected (mask first). Never in open text:
        see the module."""
        return self.rates.get(context, 0.0) > _HINT_ABOVE and not self.text.get(context, False)

    def picked_lazily(self, context: int | None, *, rejected: bool) -> None:
        rate = self.rates.get(context, 0.0)
        self.rates[context] = rate + _WEIGHT * (float(rejected) - rate)

    def picked_hinted(self, context: int | None) -> None:
        self.rates[context] = self.rates.get(context, 0.0) * self.decay

    def expects_narrow(self, context: int | None) -> bool:
        """Whether the mask at this kind of position is expected to allow few tokens (fill it ahead)."""
        return self.narrow.get(context, 1.0) > _NARROW_ABOVE and not self.text.get(context, False)

    def saw_text(self, context: int | None, *, open_text: bool) -> None:
        """Whether this kind of position inside a string is open text (see the module: never expected narrow)."""
        self.text[context] = open_text

    def sure_narrow(self, context: int | None) -> bool:
        """Whether the mask at this kind of position has been narrow nearly every time (every row there may
        be filled ahead; below, `expects_narrow` is a try)."""
        return self.narrow.get(context, 1.0) > _NARROW_SURE

    def saw_width(self, context: int | None, *, narrow: bool) -> None:
        """A filled row's mask at this kind of position was narrow or not."""
        rate = self.narrow.get(context)
        if rate is None and self.first_decides:
            self.narrow[context] = float(narrow)
            return
        rate = 1.0 if rate is None else rate
        self.narrow[context] = rate + _NARROW_WEIGHT * (float(narrow) - rate)

    def left_unfilled(self, context: int | None) -> None:
        """Not filled ahead this step (expected wide): the expectation fades towards another try."""
        rate = self.narrow.get(context, 1.0)
        self.narrow[context] = rate + self.narrow_retry
