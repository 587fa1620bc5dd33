"""The prompt-scoring reduction (`cpu_token_scores.token_scores`) against its torch reference: the same
log-normalizer to float32 accuracy and the same rank exactly, over vocabularies of any width, -inf entries (padding
rows of an embedding), ties with the target, targets at either end, row-strided logits, plus the launcher's checks."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels import cpu_build, cpu_token_scores
from structgen.kernels.cpu_token_scores import token_scores, token_scores_reference


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert cpu_token_scores.available(), f"native CPU kernels did not build: {cpu_build.unavailable_reason()}"


def _case(rows: int, vocab: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 6
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[0] = 0
    if rows > 1:
        targets[1] = vocab - 1
    return logits, targets


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (1, 7), (3, 100), (17, 4099), (256, 49152), (5, 100352)])
def test_matches_the_reference(rows: int, vocab: int) -> None:
    logits, targets = _case(rows, vocab, seed=rows + vocab)
    norm, rank = token_scores(logits, targets)
    ref_norm, ref_rank = token_scores_reference(logits, targets)
    assert norm.dtype == torch.float32 and rank.dtype == torch.int64
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=2e-5)
    assert torch.equal(rank, ref_rank)


def test_minus_infinity_entries_and_ties() -> None:
    logits, targets = _case(4, 1000, seed=3)
    logits[:, 900:] = float("-inf")  # padding rows past the tokenizer's vocabulary
    logits[2, :50] = logits[2, targets[2]]  # 50 entries tie with the target: they do not count against it
    logits[3, targets[3]] = float("-inf")  # an impossible target ranks behind every finite entry
    norm, rank = token_scores(logits, targets)
    ref_norm, ref_rank = token_scores_reference(logits, targets)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=2e-5)
    assert torch.equal(rank, ref_rank)
    assert rank[3] == torch.isfinite(logits[3]).sum() + 1
    assert rank[2] == (logits[2] > logits[2, targets[2]]).sum() + 1


def test_row_strided_logits() -> None:
    wide, targets = _case(6, 300, seed=9)
    logits = wide[:, :256]  # rows 300 apart, each contiguous
    targets = targets % 256
    norm, rank = token_scores(logits, targets)
    ref_norm, ref_rank = token_scores_reference(logits.contiguous(), targets)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=2e-5)
    assert torch.equal(rank, ref_rank)


@pytest.mark.parametrize(
    ("logits", "targets", "words"),
    [
        (torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.long), "float32"),
        (torch.zeros(2, 5).t(), torch.zeros(5, dtype=torch.long), "contiguous rows"),
        (torch.zeros(2, 5), torch.zeros(3, dtype=torch.long), "one per row"),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), "int64"),
        (torch.zeros(2, 5), torch.tensor([0, 5]), "outside the vocabulary"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), "vocab must be"),
    ],
)
def test_bad_input_is_a_value_error(logits: torch.Tensor, targets: torch.Tensor, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        token_scores(logits, targets)
