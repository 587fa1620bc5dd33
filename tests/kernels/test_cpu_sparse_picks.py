"""The sampler's native structured fast path (`cpu_sparse_picks`) against its references in `fast_picks`: the
same ids listed and the same picks, greedy and drawn, including rows with nothing possible, plus the launchers'
checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from structgen.kernels import cpu_build, cpu_sparse_picks

from structgen.engine.fast_picks import allowed_token_ids, pick_among_allowed_reference

VOCAB = 5_000


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_sparse_picks.available(), f"native CPU kernels did not build: {cpu_build.unavailable_reason()}"


def _bitmask(allowed: list[list[int]], words: int) -> torch.Tensor:
    bits = np.zeros((len(allowed), words * 32), dtype=bool)
    for row, ids in enumerate(allowed):
        bits[row, ids] = True
    packed = np.packbits(bits, axis=1, bitorder="little")
    return torch.from_numpy(packed.view(np.int32).copy())


def test_list_allowed_matches_the_reference() -> None:
    rng = np.random.default_rng(0)
    words = -(-VOCAB // 32) + 2  # a bitmask wider than the vocabulary, as a padded one is
    allowed = [
        [],
        [0],
        [VOCAB - 1],
        [3, VOCAB + 5],  # a bit past the vocabulary: counted, not listed
        sorted(rng.choice(VOCAB, 64, replace=False).tolist()),
        sorted(rng.choice(VOCAB, 65, replace=False).tolist()),  # one past the limit
        list(range(40)),
        sorted(rng.choice(VOCAB, 3_000, replace=False).tolist()),
    ]
    bitmask = _bitmask(allowed, words)
    rows = [7, 0, 1, 2, 3, 4, 5, 6, 4]  # any order, repeats allowed
    listed = cpu_sparse_picks.list_allowed(bitmask, rows, VOCAB, 64)
    packed = bitmask.numpy().view(np.uint8)
    for row, ids in zip(rows, listed, strict=True):
        expected = allowed_token_ids(packed[row], VOCAB, limit=64)
        if expected is None:
            assert ids is None, row
        else:
            assert ids is not None and ids.dtype == torch.int64 and ids.tolist() == expected.tolist(), row
    by_row = dict(zip(rows, listed, strict=True))
    assert by_row[5] is None and by_row[7] is None  # past the limit
    assert by_row[4] is not None and len(by_row[4]) == 64  # at it
    assert by_row[3] is not None and by_row[3].tolist() == [3]


def _random_case(
    seed: int, picks: int
) -> tuple[torch.Tensor, list[int], list[torch.Tensor], list[float], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    batch = picks + 3
    x = torch.randn(batch, VOCAB, generator=gen) * 4
    x[x < -7] = float("-inf")  # some impossible tokens
    rows = rng.permutation(batch)[:picks].tolist()
    ids, temperatures = [], []
    for _ in range(picks):
        size = int(rng.choice([0, 1, 2, 5, 30, 300, 2_000]))
        ids.append(torch.from_numpy(np.sort(rng.choice(VOCAB, size, replace=False)).astype(np.int64)))
        temperatures.append(float(rng.choice([1.0, 0.7, 1.3])))
    uniforms = torch.rand(picks, generator=gen, dtype=torch.float64)
    uniforms[torch.rand(picks, generator=gen) < 0.3] = float("nan")  # greedy rows
    x[rows[0]] = float("-inf")  # a row with nothing possible
    x[rows[1], ids[1][:1]] = float("nan") if len(ids[1]) else 0.0  # NaN among the allowed: not possible
    return x, rows, ids, temperatures, uniforms


@pytest.mark.parametrize("seed", range(6))
def test_pick_among_allowed_matches_the_reference(seed: int) -> None:
    x, rows, ids, temperatures, uniforms = _random_case(seed, picks=40)
    for k in range(len(temperatures)):
        if torch.isnan(uniforms[k]):
            temperatures[k] = 1.0  # as the sampler passes greedy rows
    batch = x.shape[0]
    got_ids, got_ok = torch.full((batch,), -7, dtype=torch.long), torch.zeros(batch, dtype=torch.bool)
    want_ids, want_ok = got_ids.clone(), got_ok.clone()
    cpu_sparse_picks.pick_among_allowed(x, rows, ids, temperatures, uniforms, got_ids, got_ok)
    pick_among_allowed_reference(x, rows, ids, temperatures, uniforms, want_ids, want_ok)
    assert got_ok.tolist() == want_ok.tolist()
    assert got_ids.tolist() == want_ids.tolist()
    untouched = [i for i in range(batch) if i not in rows]
    assert (got_ids[untouched] == -7).all()  # only the listed rows are written
    assert not got_ok[rows[0]] and got_ids[rows[0]] == -1


def test_draws_follow_the_masked_distribution() -> None:
    """Many draws from one row: frequencies match softmax(x[ids] / T) (chi-square), not just the reference."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, VOCAB, generator=gen)
    allowed = torch.tensor([5, 17, 400, 401, 4_999])
    draws = 20_000
    uniforms = torch.rand(draws, generator=gen, dtype=torch.float64)
    counts = torch.zeros(VOCAB)
    token_ids, ok = torch.empty(1, dtype=torch.long), torch.empty(1, dtype=torch.bool)
    for u in uniforms:
        cpu_sparse_picks.pick_among_allowed(x, [0], [allowed], [0.8], u.reshape(1), token_ids, ok)
        counts[token_ids[0]] += 1
    expected = torch.softmax(x[0, allowed] / 0.8, dim=0) * draws
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    assert counts.sum() == draws and chi2 < 18.5  # 4 degrees of freedom, p = 0.001


def test_launchers_name_a_bad_call() -> None:
    x = torch.zeros(2, VOCAB)
    token_ids, ok = torch.empty(2, dtype=torch.long), torch.empty(2, dtype=torch.bool)
    one = torch.full((1,), float("nan"), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"token id .* out of range"):
        cpu_sparse_picks.pick_among_allowed(x, [0], [torch.tensor([VOCAB])], [1.0], one, token_ids, ok)
    with pytest.raises(ValueError, match="row 2 out of range"):
        cpu_sparse_picks.pick_among_allowed(x, [2], [torch.tensor([1])], [1.0], one, token_ids, ok)
    with pytest.raises(ValueError, match="float32"):
        cpu_sparse_picks.pick_among_allowed(x.double(), [0], [torch.tensor([1])], [1.0], one, token_ids, ok)
    with pytest.raises(ValueError, match="one entry per pick"):
        cpu_sparse_picks.pick_among_allowed(x, [0, 1], [torch.tensor([1])], [1.0], one, token_ids, ok)
    with pytest.raises(ValueError, match="int32"):
        cpu_sparse_picks.list_allowed(torch.zeros(2, 8, dtype=torch.int64), [0], VOCAB, 4)
    with pytest.raises(ValueError, match="row 5 out of range"):
        cpu_sparse_picks.list_allowed(torch.zeros(2, 8, dtype=torch.int32), [5], VOCAB, 4)
