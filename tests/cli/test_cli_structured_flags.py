"""`--no-structured-budget-closing` / `--no-structured-loop-guard` reach the `StructuredOutputConfig` that
`serve`, `run-batch`, `generate` and `validate` build, and `--max-tokens-default` the server's limits. The
engine is replaced by a recorder that stops the command once it has the config: no model loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from structgen.cli import main
from structgen.config import EngineConfig


class Built(Exception):
    """Raised by the recorder in place of building the engine (no command catches it)."""


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The configs (and server limits) the commands built."""
    import structgen.engine.llm_engine as llm_engine
    import structgen.server as server
    from structgen.engine.async_engine import AsyncEngine

    seen: list[Any] = []

    class FakeEngine:
        engine = type("Inner", (), {"tokenizer": None})()

        def shutdown(self) -> None:
            pass

    def record(config: EngineConfig, *args: Any, **kwargs: Any) -> Any:
        seen.append(config)
        raise Built

    def from_config(config: EngineConfig, **_: Any) -> FakeEngine:
        seen.append(config)
        return FakeEngine()

    def build_app(*args: Any, limits: Any, **kwargs: Any) -> Any:
        seen.append(limits)
        raise Built

    monkeypatch.setattr(llm_engine, "LLMEngine", record)
    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(from_config))
    monkeypatch.setattr(server, "build_app", build_app)
    return seen


def _switches(config: EngineConfig) -> tuple[bool, bool]:
    assert config.structured is not None
    return config.structured.close_at_budget, config.structured.loop_guard


def test_serve_passes_the_switches_and_the_default_cap(built: list[Any]) -> None:
    with pytest.raises(Built):
        main(["serve", "--model", "tiny", "--no-structured-budget-closing", "--max-tokens-default", "300"])
    config, limits = built
    assert _switches(config) == (False, True) and limits.max_tokens_default == 300
    built.clear()
    with pytest.raises(Built):
        main(["serve", "--model", "tiny", "--no-structured-loop-guard"])
    config, limits = built
    assert _switches(config) == (True, False) and limits.max_tokens_default == 4096


def test_serve_refuses_a_default_cap_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "tiny", "--max-tokens-default", "0"]) == 2
    assert "max_tokens_default must be >= 1" in capsys.readouterr().err


def test_generate_and_validate_pass_the_switches(built: list[Any], tmp_path: Path) -> None:
    off = ["--no-structured-budget-closing", "--no-structured-loop-guard"]
    with pytest.raises(Built):
        main(["generate", "--model", "tiny", "--prompt", "hi", "--json-object", *off])
    with pytest.raises(Built):
        main(["generate", "--model", "tiny", "--prompt", "hi", "--json-object"])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "schema": {"type": "object"}}) + "\n")
    with pytest.raises(Built):
        main(["validate", "--schemas", str(corpus), "--model", "tiny", "--no-progress", *off])
    assert [_switches(config) for config in built] == [(False, False), (True, True), (False, False)]


def test_validate_through_a_server_refuses_the_switches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "schema": {"type": "object"}}) + "\n")
    args = [
        "validate",
        "--schemas",
        str(corpus),
        "--server",
        "http://127.0.0.1:9",
        "--no-structured-loop-guard",
    ]
    assert main(args) == 2
    assert "start the server with them" in capsys.readouterr().err


def test_run_batch_builds_what_serve_builds_with_admission_at_its_window(
    built: list[Any], tmp_path: Path
) -> None:
    """run-batch takes serve's engine options; its admission limit is the window of lines in flight, so it can
    never answer its own lines 429."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text("")
    args = ["run-batch", "-i", str(requests), "-o", str(tmp_path / "out.jsonl"), "--model", "tiny"]
    options = ["--no-structured-loop-guard", "--max-tokens-default", "300", "--kv-cache-tokens", "4096"]
    with pytest.raises(Built):
        main([*args, *options, "--max-num-seqs", "24"])
    config, limits = built
    assert _switches(config) == (True, False) and config.cache.kv_cache_tokens == 4096
    assert config.scheduler.max_num_seqs == 24
    assert (limits.max_tokens_default, limits.max_waiting_requests) == (300, 48)  # twice --max-num-seqs
    built.clear()
    with pytest.raises(Built):
        main([*args, "--max-concurrency", "5"])
    config, limits = built
    assert _switches(config) == (True, True) and limits.max_waiting_requests == 5
