"""`structgen bench decode-attention` runs end to end on a small cache and refuses bad arguments."""

from __future__ import annotations

import json

import pytest
from structgen.kernels import cpu_ops

from structgen.bench.decode_attention import main


@pytest.mark.parametrize("pages", [[], ["--plain-pages"]])
def test_the_three_layouts_are_timed_and_written(tmp_path, capsys, pages: list[str]) -> None:
    if not cpu_ops.available():  # (built on first use; every CI machine has a compiler)
        pytest.skip("no native CPU kernels on this machine")
    out = tmp_path / "attention.json"
    argv = ["--seqs", "3", "--context", "20-40", "--layers", "2", "--repeats", "2", "--pool-blocks", "64"]
    assert main([*argv, "--heads", "4,2,32", *pages, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    for layout in ("scattered", "sequential", "resident"):
        assert 0 < results[layout]["min_us"] <= results[layout]["median_us"]
    assert results["scattered_over_resident"] > 0 and results["kv_mb_per_layer"] > 0
    assert "| scattered |" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--context", "500-250"], ["--heads", "9,2,64"], ["--context", "x"]])
def test_bad_arguments_exit_with_a_message(bad: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2
    assert "--context" in capsys.readouterr().err
