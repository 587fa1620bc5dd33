"""`structgen generate`: chat messages from a file, a Pydantic model as the schema, streaming, and errors."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from structgen.cli import main

MODEL = """
from typing import Literal

from pydantic import BaseModel, ConfigDict


class Pick(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, so the object ends after it

    color: Literal["red", "green"]
"""


def test_messages_pydantic_and_stream(tmp_path: Path) -> None:
    (tmp_path / "picks.py").write_text(MODEL)
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Pick a color."}]))
    args = ["--model", "tiny", "--backend", "llguidance", "--messages", messages, "--pydantic", "picks:Pick"]
    args.append("--stream")
    result = subprocess.run(
        [sys.executable, "-m", "structgen.cli", "generate", *map(str, args), "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,  # the model's module is found in the working directory
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) in ({"color": "red"}, {"color": "green"})
    assert "[finish_reason=stop" in result.stderr
    assert "valid=True" in result.stderr and "[pydantic Pick: valid]" in result.stderr


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("[{", [], "not valid JSON: Expecting property name enclosed in double quotes (line 1)"),
        ('{"role": "user"}', [], 'expected a non-empty JSON list of {"role", "content"} messages'),
        ("[]", [], 'expected a non-empty JSON list of {"role", "content"} messages'),
        ('[{"role": "user", "content": "hi"}]', ["--pydantic", "nosuch_module_xyz:M"], None),
        (
            '[{"role": "user", "content": "hi"}]',
            ["--pydantic", "json"],
            "--pydantic takes module:Class, got 'json'",
        ),
        (
            '[{"role": "user", "content": "hi"}]',
            ["--pydantic", "json:dumps"],
            "--pydantic: json:dumps is not a Pydantic model class",
        ),
    ],
)
def test_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, extra: list[str], message: str | None
) -> None:
    path = tmp_path / "m.json"
    path.write_text(content)
    assert main(["generate", "--messages", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("structgen generate: ")
    if message is None:
        assert "cannot import nosuch_module_xyz" in err
    elif message.startswith("--"):
        assert err == f"structgen generate: {message}\n"
    else:
        assert err == f"structgen generate: {path}: {message}\n"


def test_pydantic_import_leaves_sys_path_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The working directory is searched for `--pydantic`'s module, then taken off sys.path again: left there it
    hid installed packages from later imports in the process (the repository's `kernels/` hid the package of
    that name that transformers imports)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local_models_xyz.py").write_text("VALUE = 1\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != ""])
    before = list(sys.path)
    messages = tmp_path / "m.json"
    messages.write_text('[{"role": "user", "content": "hi"}]')
    # The module is found in the working directory (the error is about the class, not the import).
    assert main(["generate", "--messages", str(messages), "--pydantic", "local_models_xyz:VALUE"]) == 2
    assert "local_models_xyz:VALUE is not a Pydantic model class" in capsys.readouterr().err
    assert sys.path == before
    assert main(["generate", "--messages", str(messages), "--pydantic", "nosuch_module_xyz:M"]) == 2
    assert sys.path == before


def test_logprobs_print_each_token_and_its_alternatives(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "3", "--logprobs", "2"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0] == "[raw_logprobs: position token value | alternatives]"
    rows = lines[1:4]
    assert [row.split()[0] for row in rows] == ["0", "1", "2"] and lines[4].startswith(
        "[finish_reason=length"
    )
    for row in rows:
        picked, alternatives = row.split(" | ")
        values = [float(part.rsplit(" ", 1)[1]) for part in alternatives.split(", ")]
        assert len(values) == 2 and values[0] >= values[1]
        # greedy (the default temperature 0): the token is the most likely one, listed first with its value
        assert float(picked.rsplit(" ", 1)[1]) == pytest.approx(values[0], abs=1e-4)
        assert values[0] < 0


def test_logprobs_under_a_grammar_and_another_mode(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "tiny", "--prompt", "hi", "--choice", "yes,no", "--backend", "llguidance"]
    assert main([*argv, "--logprobs", "5", "--logprobs-mode", "processed_logits"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[processed_logits: position token value | alternatives]"
    first = [part.rsplit(" ", 1)[0] for part in lines[1].split(" | ")[1].split(", ")]
    # only what the grammar allows is listed: the tokens "yes" or "no" can start with
    assert first and all(
        any(word.startswith(ast.literal_eval(token)) for word in ("yes", "no")) for token in first
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--logprobs-mode", "raw_logits"], "--logprobs-mode needs --logprobs"),
        (["--logprobs", "21"], "--logprobs takes 0 to 20 alternatives, got 21"),
        (["--logprobs", "-1"], "--logprobs takes 0 to 20 alternatives, got -1"),
    ],
)
def test_logprobs_usage_errors(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "tiny", "--prompt", "hi", *extra]) == 2
    assert capsys.readouterr().err == f"structgen generate: {message}\n"


def test_a_one_shot_generate_commits_its_kv_cache_as_it_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    # One request fills a few blocks of the GiB a cache holds: committing it all costs ~1 s of the start.
    from structgen.engine import llm_engine

    configs = []
    real = llm_engine.LLMEngine

    def recording(config: object) -> object:
        configs.append(config)
        return real(config)

    monkeypatch.setattr(llm_engine, "LLMEngine", recording)
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert [c.cache.commit_cpu_kv_at_start for c in configs] == [False]  # type: ignore[attr-defined]
    assert [c.pack_cpu_weights_at_start for c in configs] == [False]  # type: ignore[attr-defined]
