import math

import pytest
import torch
from sampling_reference import NEG_INF, reference_penalties

from structgen.engine.penalties import apply_penalties, ban_tokens


def test_penalties_match_the_reference_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab, generator=gen) * 3
    logits[1, [0, 3, 7]] = NEG_INF  # masked tokens that also appear in the history
    prompts = [[1, 2, 3, 3], [0, 3, 9], [5] * 20, [], [10, 11]]
    outputs = [[2, 2, 4], [3, 7, 7, 8], [], [1, 1, 1, 39], [11, 12, 12]]
    rep = [1.3, 0.7, 2.0, 1.0, 1.0]
    freq = [0.5, -1.0, 0.0, 0.3, 0.0]
    pres = [0.25, 2.0, 0.0, -0.5, 0.0]
    expected = [
        reference_penalties(logits[i].tolist(), prompts[i], outputs[i], rep[i], freq[i], pres[i])
        for i in range(5)
    ]
    got = logits.clone()
    apply_penalties(got, prompts, outputs, repetition=rep, frequency=freq, presence=pres)
    for i in range(5):
        for token in range(vocab):
            e, g = expected[i][token], got[i, token].item()
            assert (math.isinf(e) and g == e) or g == pytest.approx(e, abs=1e-5), (i, token)


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [[0, 1]], [[2, 2]], repetition=[1.0], frequency=[1.0], presence=[0.5])
    assert logits.tolist() == [[0.0, 0.0, -2.5, 0.0]]


def test_out_of_vocabulary_history_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"row 1: output token id 9 is outside the vocabulary \[0, 4\)"):
        apply_penalties(
            torch.zeros(2, 4),
            [[], []],
            [[1], [9]],
            repetition=[1.0] * 2,
            frequency=[1.0] * 2,
            presence=[0.0] * 2,
        )


def test_ban_sets_minus_inf_and_ignores_ids_outside_the_vocabulary() -> None:
    logits = torch.arange(12, dtype=torch.float32).view(2, 6)
    ban_tokens(logits, [(0, [1, 5, 99]), (1, [0, 0])])
    assert logits[0].tolist() == [0.0, NEG_INF, 2.0, 3.0, 4.0, NEG_INF]
    assert logits[1].tolist() == [NEG_INF, 7.0, 8.0, 9.0, 10.0, 11.0]


def test_ban_leaves_a_row_alone_when_it_would_leave_nothing_possible() -> None:
    # Row 0: the structured-output mask allows only EOS (id 2); banning it would leave nothing to sample.
    logits = torch.full((2, 4), NEG_INF)
    logits[0, 2] = 1.5
    logits[1] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    ban_tokens(logits, [(0, [2]), (1, [2])])
    assert logits[0].tolist() == [NEG_INF, NEG_INF, 1.5, NEG_INF]
    assert logits[1].tolist() == pytest.approx([0.1, 0.2, NEG_INF, 0.4])
