"""`structgen bench speculative` end to end at toy sizes on `tiny`: every load reported, outputs identical."""

from __future__ import annotations

import json
from pathlib import Path

from structgen.bench.speculative import main


def test_a_small_run_reports_every_load(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    args = ["--model", "tiny", "--requests", "3", "--single-requests", "1", "--wide-requests", "4"]
    assert main([*args, "--max-tokens", "12", "--passes", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["loads"]) == 5 and "tickets single" in result["loads"]
    for load in result["loads"].values():
        assert load["off_tok_s"] > 0 and load["ngram_tok_s"] > 0
        same, total = map(int, load["identical"].split("/"))
        assert same == total > 0
