import pytest
import torch
from sampling_reference import NEG_INF, reference_kept

from structgen.engine.truncation import apply_min_p, apply_top_k_top_p


def kept_set(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > 0).flatten().tolist())


def test_top_k_and_top_p_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 20_000
    scales = [3.0, 3.0, 0.05, 3.0, 2.0, 3.0, 3.0, 2.0, 3.0]
    logits = torch.stack([torch.randn(vocab, generator=gen, dtype=torch.float64) * s for s in scales]).float()
    logits[3, ::2] = NEG_INF
    top_k = [0, 20, 0, 7, 0, -1, 1, 2500, 0]
    top_p = [0.5, 1.0, 0.95, 0.5, 0.5, 1e-6, 0.9, 0.99, 0.9]
    probs = logits.softmax(dim=1)
    got = probs.clone()
    apply_top_k_top_p(got, top_k, top_p)
    for i in range(len(scales)):
        expected = reference_kept(logits[i].double().tolist(), top_k[i], top_p[i])
        assert kept_set(got[i]) == expected, i
        assert torch.equal(got[i][got[i] > 0], probs[i][got[i] > 0])
    # The nuclei of rows 4 and 8 outgrow the first 256 candidates (retry with topk(2048)); row 2 is nearly
    # flat and outgrows those too (a full sort).
    assert 256 < len(kept_set(got[4])) < 2048 and 256 < len(kept_set(got[8])) < 2048
    assert len(kept_set(got[2])) > 2048
    assert len(kept_set(got[5])) == 1 and len(kept_set(got[6])) == 1


def test_rows_with_both_steps_off_are_untouched() -> None:
    logits = torch.randn(3, 50)
    logits[1, :10] = NEG_INF
    probs = logits.softmax(dim=1)
    got = probs.clone()
    apply_top_k_top_p(got, [0, -1, 50], [1.0, 1.0, 1.0])
    assert torch.equal(got, probs)


def test_ties_at_the_top_k_cutoff_are_kept() -> None:
    probs = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]]).softmax(dim=1)
    apply_top_k_top_p(probs, [2], [1.0])
    assert kept_set(probs[0]) == {1, 2, 3}


def test_min_p_keeps_tokens_at_least_min_p_times_the_likeliest() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 200, generator=gen) * 2
    logits[2, 50:] = NEG_INF
    min_p = [0.1, 0.0, 0.5, 1.0]
    got = logits.softmax(dim=1)
    apply_min_p(got, min_p)
    for i, threshold in enumerate(min_p):
        probs = torch.softmax(logits[i].double(), dim=0).tolist()
        best = max(probs)
        expected = {t for t, p in enumerate(probs) if p > 0 and p >= threshold * best}
        assert kept_set(got[i]) == expected, i


def test_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="top_k has 1 and top_p 2 entries for 2 rows"):
        apply_top_k_top_p(torch.zeros(2, 5), [1], [1.0, 1.0])
