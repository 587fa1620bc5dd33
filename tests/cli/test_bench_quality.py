"""`structgen bench quality` scores the same BFCL text under each quantization setting against the first one."""

from __future__ import annotations

import json
import math

import pytest

from structgen.bench import shared_data
from structgen.bench.quality import documents, main


def test_documents_are_bfcl_questions_and_their_functions() -> None:
    texts = documents(shared_data(), count=3)
    assert len(texts) == 3 and len(set(texts)) == 3
    question, functions = texts[0].split("\n", 1)
    assert question.strip() and isinstance(json.loads(functions), list)


def test_each_setting_is_compared_with_the_reference(tmp_path, capsys) -> None:
    out = tmp_path / "quality.json"
    # tiny has no 4-bit form (its widths are not multiples of 32): "auto" leaves it dense, a second scoring run.
    argv = ["--model", "tiny", "--quantization", "none,auto", "--documents", "3", "--max-doc-tokens", "24"]
    assert main([*argv, "--chunk", "16", "--json", str(out)]) == 0
    reference, quantized = json.loads(out.read_text())["rows"]
    assert reference["quantization"] == "none" and quantized["quantization"] == "auto"
    assert reference["tokens"] == quantized["tokens"] == 3 * 23
    assert reference["dnll_mean"] == reference["dnll_max"] == 0.0 and reference["top1_agreement"] == 1.0
    assert quantized["dnll_max"] < 1e-4 and quantized["top1_agreement"] == 1.0
    assert quantized["nll"] == pytest.approx(reference["nll"], abs=1e-5)
    for row in (reference, quantized):
        assert math.isfinite(row["nll"]) and row["ppl"] == pytest.approx(math.exp(row["nll"]))
    assert "setting" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--quantization", "none,fp8"], ["--quantization", ""], ["--chunk", "0"], ["--max-doc-tokens", "1"]],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--model", "tiny", *argv])
    assert refused.value.code not in (0, None)
