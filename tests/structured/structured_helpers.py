"""Compiling JSON Schemas and walking token sequences through grammars while checking each step's mask (shared
by the tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from structgen.structured import Grammar, StructuredBackend, StructuredOutputsParams, allocate_token_bitmask
from structgen.structured.bitmask import unpack_bitmask


def allowed_tokens(grammar: Grammar, vocab_size: int) -> torch.Tensor:
    """Bool mask of the tokens `grammar` allows next (filled into row 1 of a 3-row bitmask)."""
    bitmask = allocate_token_bitmask(3, vocab_size)
    grammar.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all(), "fill_bitmask wrote outside its row"
    return unpack_bitmask(bitmask[1], vocab_size)


def walk(grammar: Grammar, token_ids: Sequence[int], vocab_size: int) -> list[torch.Tensor]:
    """Accept `token_ids` one at a time, asserting that each one is allowed by the mask just before it;
    returns the masks seen (one per step, plus the final one)."""
    masks = []
    for step, token in enumerate(token_ids):
        allowed = allowed_tokens(grammar, vocab_size)
        masks.append(allowed)
        assert allowed[token], f"step {step}: token {token} is masked"
        assert grammar.accept_tokens([token]), f"step {step}: token {token} rejected"
    masks.append(allowed_tokens(grammar, vocab_size))
    return masks


def accepts_text(grammar: Grammar, token_ids: Sequence[int], eos: int) -> bool:
    """Whether a copy of `grammar` accepts the whole sequence and then EOS."""
    g = grammar.clone()
    return g.accept_tokens(token_ids) and g.accept_tokens([eos])


def compile_schema(backend: StructuredBackend, schema: dict[str, Any]) -> Grammar:
    """`schema`'s grammar on `backend` (`{"type": "object"}` as `json_object`)."""
    params = StructuredOutputsParams(json=schema) if schema != {"type": "object"} else None
    spec = (params or StructuredOutputsParams(json_object=True)).to_spec()
    return backend.compile(spec)
