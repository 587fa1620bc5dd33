"""`structgen bench prefill-attention` runs end to end on small cases and refuses bad arguments."""

from __future__ import annotations

import json

import pytest
import torch
from structgen.kernels import cpu_prefill_attention

from structgen.bench.prefill_attention import main


def test_both_paths_are_timed_agree_and_are_written(tmp_path, capsys) -> None:
    if not cpu_prefill_attention.available(torch.float32):
        pytest.skip("the fp32 prefill kernel does not run on this machine")
    out = tmp_path / "prefill.json"
    argv = ["--cases", "40,30/70", "--heads", "4,2,32", "--dtype", "float32", "--repeats", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["new"], r["context"]) for r in rows] == [(40, 40), (30, 70)]
    for row in rows:
        for path in ("kernel", "sdpa"):
            assert 0 < row[path]["min_ms"] <= row[path]["median_ms"]
        assert row["max_abs_diff"] < 1e-4  # the same attention either way
    assert "| 30 / 70 |" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--cases", "70/30"], ["--cases", "x"], ["--heads", "9,2,64"]])
def test_bad_arguments_exit_with_a_message(bad: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2
    assert "--cases" in capsys.readouterr().err
