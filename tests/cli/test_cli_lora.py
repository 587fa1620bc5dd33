"""The LoRA flags of `serve`, `run-batch` and `generate` on `tiny`: `--lora-modules` in vLLM's two forms (and what
is wrong with a value, said in one line before the model loads), the size flags, a real `structgen serve` that
lists and routes its adapters, a bad adapter refused at start, batch lines routed by `model`, and
`generate --lora-path`."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from cli_helpers import structgen, write_jsonl
from live_server import start_structgen_serve

from structgen.cli import _build_parser, main
from structgen.commands.engine_args import engine_config
from structgen.commands.lora_flags import lora_modules, parse_lora_module
from structgen.config import LoRAConfig

PROMPT = "Once upon a time"
ENGINE = ["--model", "tiny", "--dtype", "float32", "--kv-cache-tokens", "2048", "--max-num-seqs", "8"]


def serve_args(*flags: str) -> Any:
    return _build_parser().parse_args(["serve", "--model", "tiny", *flags])


# -- the flags ------------------------------------------------------------------------------------------------


def test_lora_modules_forms(tiny_lora_adapters: dict[str, Path]) -> None:
    sql, poet = str(tiny_lora_adapters["sql"]), str(tiny_lora_adapters["poet"])
    spec = json.dumps({"name": "poet", "path": poet, "base_model_name": "tiny-base"})
    args = serve_args("--lora-modules", f"sql={sql}", spec, "--lora-modules", f"more={sql}")
    first, second, third = lora_modules(args, model_name="tiny")
    assert (first.lora_name, first.lora_path, first.lora_int_id, first.base_model_name) == (
        "sql",
        sql,
        1,
        None,
    )
    assert (second.lora_name, second.lora_path, second.base_model_name) == ("poet", poet, "tiny-base")
    assert (third.lora_name, third.lora_int_id) == ("more", 3)
    # --lora-modules turns LoRA on by itself; the size flags reach the engine's config.
    assert engine_config(args).lora == LoRAConfig()
    sized = serve_args("--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "3")
    assert engine_config(sized).lora == LoRAConfig(max_loras=2, max_lora_rank=32, max_cpu_loras=3)
    assert engine_config(serve_args()).lora is None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("sql", "takes name=path or a JSON object"),
        ("=DIR", "has no name"),
        ("sql=", "has no path"),
        ('{"name": "sql"', "not valid JSON"),
        ('{"name": "sql", "path": "DIR", "rank": 8}', "unknown keys ['rank']"),
        ('{"path": "DIR"}', "has no name"),
        ("sql=DIR/missing", "--lora-modules sql: no LoRA adapter directory at"),
    ],
)
def test_a_bad_lora_module_says_what_is_wrong(value: str, words: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as error:
        parse_lora_module(value.replace("DIR", str(tmp_path)))
    assert words in str(error.value)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--max-loras", "2"], "--max-loras needs --enable-lora"),
        (["--max-lora-rank", "8"], "--max-lora-rank needs --enable-lora"),
        (["--enable-lora", "--max-loras", "0"], "max_loras must be >= 1"),
        (
            ["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
            "max_cpu_loras (2) must be >= max_loras",
        ),
        (["--lora-modules", "tiny=DIR"], "'tiny' is the base model's name"),
        (["--lora-modules", "a=DIR", "a=DIR"], "names 'a' twice"),
        (
            ["--max-loras", "1", "--max-cpu-loras", "1", "--lora-modules", "a=DIR", "b=DIR"],
            "more than --max-cpu",
        ),
    ],
)
def test_serve_refuses_bad_lora_flags_before_loading_anything(
    flags: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", "tiny", *(f.replace("DIR", str(tmp_path)) for f in flags)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("structgen serve: ") and words in err and len(err.splitlines()) == 1, err


# -- structgen serve ------------------------------------------------------------------------------------------


def test_serve_with_a_missing_adapter_directory_exits_with_one_line(tmp_path: Path) -> None:
    result = structgen("serve", "--model", "tiny", "--lora-modules", f"sql={tmp_path / 'missing'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"structgen serve: --lora-modules sql: no LoRA adapter directory at '{tmp_path / 'missing'}'"
    ]


def test_serve_with_an_adapter_the_model_cannot_serve_exits_with_one_line(
    tiny_lora_adapters: dict[str, Path],
) -> None:
    sql = tiny_lora_adapters["sql"]  # rank 8
    result = structgen("serve", *ENGINE, "--max-lora-rank", "4", "--lora-modules", f"sql={sql}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("structgen serve:")]
    assert errors == [result.stderr.strip().splitlines()[-1]], result.stderr
    assert errors[0].startswith("structgen serve: LoRA adapter 'sql': adapter module ")
    assert "rank 8, above max_lora_rank 4" in errors[0]


def test_serve_lists_and_routes_its_adapters(tiny_lora_adapters: dict[str, Path]) -> None:
    poet = json.dumps(
        {"name": "poet", "path": str(tiny_lora_adapters["poet"]), "base_model_name": "tiny-base"}
    )
    args = [*ENGINE, "--api-key", "k", "--lora-modules", f"sql={tiny_lora_adapters['sql']}", poet]
    server, url = start_structgen_serve(args)
    try:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=30) as client:
            cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
            assert list(cards) == ["tiny", "sql", "poet"]
            assert cards["sql"]["parent"] == "tiny" and cards["poet"]["parent"] == "tiny-base"
            body = {"model": "poet", "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200 and answer.json()["model"] == "poet", answer.text
            unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert unloaded.status_code == 200, unloaded.text
            assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["tiny", "poet"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
    log = server.stdout.read() if server.stdout else ""
    assert "LoRA adapter 'sql' loaded from" in log and "LoRA adapter 'poet' loaded from" in log, log


# -- run-batch and generate -----------------------------------------------------------------------------------


def test_run_batch_routes_each_line_by_model(tiny_lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    rows = [
        {"custom_id": m, "method": "POST", "url": "/v1/completions", "body": {"model": m, **body}}
        for m in ("tiny", "sql", "nope")
    ]
    requests, results = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    flags = ["--lora-modules", f"sql={tiny_lora_adapters['sql']}", "--no-progress"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stderr", io.StringIO())
        code = main(["run-batch", "-i", str(requests), "-o", str(results), *ENGINE, *flags])
    assert code == 1  # the unknown model's line
    out = {line["custom_id"]: line["response"] for line in map(json.loads, results.read_text().splitlines())}
    assert out["tiny"]["status_code"] == out["sql"]["status_code"] == 200
    assert out["sql"]["body"]["model"] == "sql"
    assert out["sql"]["body"]["choices"][0]["text"] != out["tiny"]["body"]["choices"][0]["text"]
    assert out["nope"]["status_code"] == 404 and out["nope"]["body"]["error"]["code"] == "model_not_found"


def test_run_batch_refuses_a_bad_adapter_in_one_line(
    tiny_lora_adapters: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = write_jsonl(tmp_path / "in.jsonl", [])
    flags = ["--max-lora-rank", "4", "--lora-modules", f"sql={tiny_lora_adapters['sql']}"]
    assert main(["run-batch", "-i", str(requests), "-o", str(tmp_path / "out.jsonl"), *ENGINE, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("structgen run-batch: LoRA adapter 'sql': ") and "max_lora_rank 4" in err[-1]


def test_generate_with_a_lora_path(
    tiny_lora_adapters: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "generate",
        "--model",
        "tiny",
        "--dtype",
        "float32",
        "--raw",
        "--prompt",
        PROMPT,
        "--max-tokens",
        "6",
    ]
    assert main(args) == 0
    base = capsys.readouterr().out
    assert main([*args, "--lora-path", str(tiny_lora_adapters["sql"])]) == 0
    assert capsys.readouterr().out != base


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--lora-path", "MISSING"], "--lora-path: no LoRA adapter directory at"),
        (["--max-lora-rank", "8"], "--max-lora-rank needs --lora-path"),
    ],
)
def test_generate_refuses_bad_lora_flags_before_loading_anything(
    flags: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [f.replace("MISSING", str(tmp_path / "missing")) for f in flags]
    assert main(["generate", "--model", "tiny", "--prompt", PROMPT, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("structgen generate: ") and words in err and len(err.splitlines()) == 1, err
