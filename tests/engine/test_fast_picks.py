"""Cheap exact picks: chunked argmax equals torch.argmax; picking among a sparse mask's allowed tokens equals
masking the whole row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_reference import NEG_INF

from structgen.engine.fast_picks import SPARSE_LIMIT, allowed_token_ids, pick_among, row_argmax
from structgen.structured.bitmask import allocate_token_bitmask, allow_tokens


@pytest.mark.parametrize("vocab", [100352, 49152, 4096, 1000, 7])
def test_row_argmax_equals_torch_argmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1] = NEG_INF  # nothing allowed: index 0, like torch
    x[2, vocab // 3] = x[2, -1] = 50.0  # a tie: the first one
    x[3, -1] = float("nan")  # NaN counts as the maximum
    x[4, 0] = float("inf")
    x[4, vocab // 2] = float("nan")
    x[5, :] = 1.0  # all equal
    x[6, -1] = float("inf")
    x[7] = torch.round(x[7])  # many ties
    expected = x.argmax(dim=1)
    assert torch.equal(row_argmax(x), expected)
    assert torch.equal(row_argmax(x[::2]), x[::2].argmax(dim=1))  # non-contiguous rows


def _packed(vocab: int, allowed: list[int]) -> np.ndarray:
    bitmask = allocate_token_bitmask(1, vocab)
    bitmask.zero_()
    allow_tokens(bitmask, 0, allowed)
    return bitmask.numpy().view(np.uint8)[0]


def test_allowed_token_ids_reads_the_bits_and_gives_up_past_the_limit() -> None:
    vocab = 100_000
    allowed = [0, 7, 8, 31, 32, 4095, 99_999]
    assert allowed_token_ids(_packed(vocab, allowed), vocab).tolist() == allowed
    assert allowed_token_ids(_packed(vocab, []), vocab).tolist() == []
    # Ids past the logits' width are dropped even if a (wider) mask allowed them.
    assert allowed_token_ids(_packed(vocab, [3, 99_999]), 50_000).tolist() == [3]
    many = list(range(0, 2 * SPARSE_LIMIT + 2, 2))  # SPARSE_LIMIT + 1 tokens
    assert allowed_token_ids(_packed(vocab, many), vocab) is None
    assert allowed_token_ids(_packed(vocab, many[:-1]), vocab).tolist() == many[:-1]
    assert allowed_token_ids(_packed(vocab, list(range(SPARSE_LIMIT + 1))), vocab) is None


def test_pick_among_greedy_sampled_and_impossible() -> None:
    values = torch.tensor([0.5, 2.0, 2.0, NEG_INF])
    assert pick_among(values) == (1, True)  # the first maximum
    assert pick_among(torch.full((3,), NEG_INF))[1] is False
    assert pick_among(torch.full((3,), NEG_INF), uniform=torch.tensor(0.5))[1] is False
    assert pick_among(torch.tensor([1.0, float("nan")]), uniform=torch.tensor(0.5))[1] is False
    assert pick_among(torch.empty(0), uniform=torch.tensor(0.5)) == (0, False)
    # Sampled: the CDF of softmax(values); -inf entries are never picked.
    probs = torch.softmax(values.double(), 0)
    cum = probs.cumsum(0)
    for u in (0.0, 0.1, float(cum[0]) + 1e-9, 0.6, 0.999999):
        index, possible = pick_among(values, uniform=torch.tensor(u, dtype=torch.float64))
        assert possible and index == int((cum > u).nonzero()[0]) and index != 3


@pytest.mark.parametrize("native", [True, False])
def test_batch_listing_and_picks_take_either_path(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """`list_allowed_rows` and `pick_among_allowed` give the reference's results with the native kernels and
    without them (no compiler, or STRUCTGEN_CPU_KERNELS=0)."""
    from structgen.engine import fast_picks

    if not native:
        monkeypatch.setattr(fast_picks, "_native", lambda: None)
    else:
        assert fast_picks._native() is not None
    vocab = 3000
    bitmask = allocate_token_bitmask(3, vocab)
    bitmask.zero_()
    allow_tokens(bitmask, 0, [4, 7, 2999])
    allow_tokens(bitmask, 1, list(range(0, vocab, 2)))  # wide
    listed = fast_picks.list_allowed_rows(bitmask, [1, 0, 2], vocab, limit=64)
    assert listed[0] is None and listed[1].tolist() == [4, 7, 2999] and listed[2].tolist() == []
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, vocab, generator=gen)
    ids = [torch.tensor([4, 7, 2999]), torch.tensor([1, 2]), torch.tensor([10, 11, 12])]
    uniforms = torch.tensor([0.25, float("nan"), 0.9], dtype=torch.float64)
    token_ids, ok = torch.full((4,), -5), torch.zeros(4, dtype=torch.bool)
    fast_picks.pick_among_allowed(x, [3, 0, 1], ids, [0.5, 1.0, 1.0], uniforms, token_ids, ok)
    want_ids, want_ok = torch.full((4,), -5), torch.zeros(4, dtype=torch.bool)
    fast_picks.pick_among_allowed_reference(x, [3, 0, 1], ids, [0.5, 1.0, 1.0], uniforms, want_ids, want_ok)
    assert token_ids.tolist() == want_ids.tolist() and ok.tolist() == want_ok.tolist() == [
        True,
        True,
        False,
        True,
    ]
    assert token_ids[0] == 1 + int(x[0, 1:3].argmax())  # the greedy row: its first maximum
