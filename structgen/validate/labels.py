"""Grammar vs labels: does a compiled grammar accept each valid MaskBench instance and refuse each invalid one?

Instances are serialized compact with `ensure_ascii=False` (the form a constrained model writes: llguidance's
strings do not take every `\\uXXXX` escape), tokenized, and walked through a fresh grammar up to EOS.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from structgen.structured import CompiledSpec, Grammar


@dataclass(slots=True)
class LabelCounts:
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_accepted: int = 0

    @property
    def total(self) -> int:
        return self.valid + self.invalid

    @property
    def agree(self) -> int:
        """Instances the grammar judges as their label says."""
        return self.valid_accepted + (self.invalid - self.invalid_accepted)

    def add(self, other: LabelCounts) -> None:
        self.valid += other.valid
        self.valid_accepted += other.valid_accepted
        self.invalid += other.invalid
        self.invalid_accepted += other.invalid_accepted

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def instance_text(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def grammar_accepts(grammar: Grammar, token_ids: Sequence[int], eos_token_id: int) -> bool:
    """Whether `grammar` (fresh) takes all of `token_ids` and then may end."""
    return grammar.accept_tokens(list(token_ids)) and grammar.accept_tokens([eos_token_id])


def check_labels(
    compiled: CompiledSpec,
    tests: Sequence[dict[str, Any]],
    *,
    encode: Callable[[str], list[int]],
    eos_token_id: int,
) -> LabelCounts:
    counts = LabelCounts()
    for test in tests:
        accepted = grammar_accepts(compiled.new_grammar(), encode(instance_text(test["data"])), eos_token_id)
        if test["valid"]:
            counts.valid += 1
            counts.valid_accepted += accepted
        else:
            counts.invalid += 1
            counts.invalid_accepted += accepted
    return counts
