"""`--reasoning-parser` and `--thinking-token-budget` on `serve` and `run-batch`: the flags reach the engine's
config, a batch on `tiny-thinking` answers with the reasoning apart (the server's budget applying to requests that
set none), and a model without the markers, an unknown parser or a budget without a parser are refused with one
clear line and a non-zero exit, not a traceback."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cli_helpers import structgen, write_jsonl

from structgen.cli import _build_parser, main
from structgen.commands.engine_args import engine_config

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Give me a number."}]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}
BUDGET = 6
ENGINE = ["--kv-cache-tokens", "2048", "--max-num-seqs", "8", "--structured-backend", "llguidance"]


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run_batch(tmp_path: Path, rows: list[Any], *flags: str) -> tuple[int, list[dict[str, Any]], str]:
    requests = write_jsonl(tmp_path / "requests.jsonl", rows)
    results = tmp_path / "results.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        stderr = io.StringIO()
        patch.setattr("sys.stderr", stderr)
        code = main(["run-batch", "-i", str(requests), "-o", str(results), "--no-progress", *ENGINE, *flags])
    lines = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    return code, lines, stderr.getvalue()


def test_the_flags_reach_the_engine_config() -> None:
    args = _build_parser().parse_args(
        ["serve", "--reasoning-parser", "qwen3", "--thinking-token-budget", "64"]
    )
    config = engine_config(args)
    assert (config.reasoning_parser, config.thinking_token_budget) == ("qwen3", 64)
    plain = engine_config(_build_parser().parse_args(["serve"]))
    assert (plain.reasoning_parser, plain.thinking_token_budget) == (None, None)


def test_a_batch_on_a_reasoning_model_reports_the_reasoning_apart(tmp_path: Path) -> None:
    rows = [
        line("chat", CHAT, {"messages": USER, "response_format": FORMAT, "max_tokens": 40}),
        line("completion", "/v1/completions", {"prompt": "Once upon", "max_tokens": 4, "ignore_eos": True}),
        line("responses", "/v1/responses", {"input": "Hi", "max_output_tokens": 12}),
    ]
    flags = [
        "--model",
        "tiny-thinking",
        "--reasoning-parser",
        "deepseek_r1",
        "--thinking-token-budget",
        str(BUDGET),
    ]
    code, outputs, stderr = run_batch(tmp_path, rows, *flags)
    assert code == 0, stderr
    chat, completion, responses = (o["response"]["body"] for o in outputs)
    message = chat["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert message["reasoning"] and message["reasoning_content"] == message["reasoning"]
    # The server's budget, as the request set none: its tokens and the forced `</think>`.
    assert chat["usage"]["completion_tokens_details"] == {"reasoning_tokens": BUDGET + 1}
    assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 0
    }
    assert responses["output"][0]["type"] == "reasoning"
    assert responses["usage"]["output_tokens_details"] == {"reasoning_tokens": BUDGET + 1}


def test_a_model_without_the_markers_is_refused_by_run_batch(tmp_path: Path) -> None:
    rows = [line("a", CHAT, {"messages": USER})]
    code, _, stderr = run_batch(tmp_path, rows, "--model", "tiny", "--reasoning-parser", "qwen3")
    assert code == 1 and stderr.startswith("structgen run-batch: ") and "'<think>'" in stderr, stderr
    assert "Traceback" not in stderr


def test_serve_refuses_a_model_without_the_markers() -> None:
    result = structgen("serve", "--model", "tiny", "--reasoning-parser", "qwen3", "--port", "0", *ENGINE)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("structgen serve: reasoning parser 'qwen3' needs '<think>'"), result.stderr
    assert "--reasoning-parser" in last and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--thinking-token-budget", "8"], "--thinking-token-budget needs --reasoning-parser"),
        (["--reasoning-parser", "qwen3", "--thinking-token-budget", "-1"], "must be >= 0"),
    ],
)
def test_serve_refuses_a_bad_budget_before_loading_anything(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("structgen serve: ") and words in err, err


def test_an_unknown_parser_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--reasoning-parser", "gpt"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'gpt'" in err and "deepseek_r1" in err and "qwen3" in err


def test_generate_prints_the_answer_and_sends_the_reasoning_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["--model", "tiny-thinking", "--prompt", "Give me a number.", "--max-tokens", "48"]
    flags += ["--reasoning-parser", "deepseek_r1", "--thinking-token-budget", "5", "--json-object"]
    for stream in ([], ["--stream"]):
        assert main(["generate", *flags, *stream]) == 0
        out, err = capsys.readouterr()
        assert isinstance(json.loads(out), dict), out  # the answer alone, under the constraint
        assert err.strip() and not any(marker in out + err for marker in ("<think>", "</think>"))


def test_generate_refuses_a_model_without_the_markers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--reasoning-parser", "qwen3"]) == 2
    assert "needs '<think>' as one token" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--thinking-token-budget", "3"]) == 2
    assert "--thinking-token-budget needs --reasoning-parser" in capsys.readouterr().err
