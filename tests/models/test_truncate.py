"""`write_truncated_checkpoint`: the first layers of tiny load as a model of their own, with the same tokenizer
and every parameter equal to the full model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structgen.models.loader import load_model
from structgen.models.registry import resolve_model
from structgen.models.truncate import write_truncated_checkpoint
from structgen.tokenizer import Tokenizer


def test_the_first_layers_load_as_a_model_with_the_same_tokenizer(tmp_path: Path) -> None:
    source = resolve_model("tiny")
    draft_dir = write_truncated_checkpoint(source, tmp_path / "draft", num_layers=1)
    draft = load_model(draft_dir, dtype="float32")
    full = load_model(source, dtype="float32")
    assert draft.config.num_hidden_layers == 1 < full.config.num_hidden_layers
    assert Tokenizer.from_dir(draft_dir).backend.get_vocab() == Tokenizer.from_dir(source).backend.get_vocab()
    full_params = dict(full.named_parameters())
    for name, param in draft.named_parameters():
        assert torch.equal(param, full_params[name]), name


@pytest.mark.parametrize("num_layers", [0, 99])
def test_a_layer_count_the_source_lacks_is_refused(tmp_path: Path, num_layers: int) -> None:
    with pytest.raises(ValueError, match="num_layers must be in 1"):
        write_truncated_checkpoint(resolve_model("tiny"), tmp_path / "draft", num_layers=num_layers)
