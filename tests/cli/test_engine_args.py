"""The engine options of `structgen serve` / `run-batch` reach `EngineConfig`; a bad value is a usage error."""

from __future__ import annotations

import pytest

from structgen.cli import _build_parser
from structgen.commands.engine_args import engine_config
from structgen.config import LOGPROBS_MODES


def test_logprobs_mode_reaches_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = _build_parser()
    assert engine_config(parser.parse_args(["serve"])).logprobs_mode == "raw_logprobs"
    for mode in LOGPROBS_MODES:
        assert engine_config(parser.parse_args(["serve", "--logprobs-mode", mode])).logprobs_mode == mode
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["serve", "--logprobs-mode", "logits"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'logits'" in capsys.readouterr().err
