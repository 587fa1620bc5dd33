"""`structgen bench speculative` end to end at toy sizes on `tiny`: every load reported for every side (n-gram,
and a draft model: the target's first layer), outputs identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structgen.bench.speculative import main

SMALL = [
    "--model",
    "tiny",
    "--requests",
    "3",
    "--single-requests",
    "1",
    "--wide-requests",
    "4",
    "--max-tokens",
    "12",
]


def test_a_small_run_reports_every_load(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    assert main([*SMALL, "--passes", "1", "--draft-layers", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["loads"]) == 5 and "tickets single" in result["loads"]
    for load in result["loads"].values():
        assert load["off_tok_s"] > 0
        for side in ("ngram", "draft"):
            assert load[side]["tok_s"] > 0
            same, total = map(int, load[side]["identical"].split("/"))
            assert same == total > 0
    assert sum(load["draft"]["proposed"] for load in result["loads"].values()) > 0


def test_a_draft_layer_count_the_model_lacks_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, "--draft-layers", "99"])
    assert exit_info.value.code == 2
    assert "num_layers must be in 1.." in capsys.readouterr().err
