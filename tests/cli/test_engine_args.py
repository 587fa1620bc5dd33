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


def test_the_cpu_kv_cache_size_reaches_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    from structgen.cli import main

    parser = _build_parser()
    assert engine_config(parser.parse_args(["serve"])).cache.cpu_kv_cache_gib == 1.0
    config = engine_config(parser.parse_args(["serve", "--cpu-kv-cache-gib", "0.25"]))
    assert config.cache.cpu_kv_cache_gib == 0.25 and config.cache.kv_cache_tokens is None
    assert main(["serve", "--model", "tiny", "--cpu-kv-cache-gib", "0"]) == 2
    assert capsys.readouterr().err.strip() == "structgen serve: cpu_kv_cache_gib must be > 0, got 0.0"
