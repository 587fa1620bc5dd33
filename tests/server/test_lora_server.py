"""LoRA adapters over the server on `tiny`: `/v1/models` lists them, `model` chooses one on chat, completions and
the Responses API (the same greedy tokens as the offline engine with that adapter, not the base model's), the
official `openai` SDK, loading and unloading at run time (a running stream finishes), and every refusal as an
OpenAI error body."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from live_server import serve, wait_idle
from safetensors.torch import load_file, save_file
from server_helpers import AUTH, KEY, USER, assert_error, call, sse_events

from structgen.config import CacheConfig, EngineConfig, LoRAConfig
from structgen.engine.async_engine import AsyncEngine
from structgen.engine.llm_engine import LLMEngine
from structgen.lora import LoRARequest
from structgen.sampling_params import SamplingParams
from structgen.server import build_app

PROMPT = "Once upon a time"
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
MAX_LORA_RANK = 8


def config() -> EngineConfig:
    lora = LoRAConfig(max_loras=2, max_lora_rank=MAX_LORA_RANK)
    return EngineConfig(
        model="tiny", device="cpu", dtype="float32", cache=CacheConfig(kv_cache_tokens=2048), lora=lora
    )


@pytest.fixture(scope="module")
def lora_engine(tiny_lora_adapters: dict[str, Path]) -> Iterator[AsyncEngine]:
    """Serves "sql" from the start (as `--lora-modules` does); "poet" is loaded and unloaded by the tests."""
    sql = LoRARequest("sql", 1, str(tiny_lora_adapters["sql"]))
    engine = AsyncEngine.from_config(config(), lora_modules=[sql])
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(lora_engine: AsyncEngine) -> Any:
    return build_app(lora_engine, lora_engine.engine.tokenizer, model_name="tiny", api_key=KEY)


@pytest.fixture(scope="module")
def offline(tiny_lora_adapters: dict[str, Path]) -> Any:
    """`offline(prompt, adapter name or None, max_tokens)`: the offline engine's greedy text."""
    engine = LLMEngine(config())

    def run(prompt: Any, name: str | None, max_tokens: int = 6) -> str:
        lora = LoRARequest(name, 1, str(tiny_lora_adapters[name])) if name else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request("ref", prompt, params, lora_request=lora)
        final = None
        while engine.has_unfinished():
            final = next((o for o in engine.step() if o.finished), final)
        assert final is not None
        return final.outputs[0].text

    yield run
    engine.shutdown()


def chat_prompt(engine: AsyncEngine) -> dict[str, Any]:
    tokenizer = engine.engine.tokenizer
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def model_ids(app: Any) -> list[str]:
    return [card["id"] for card in call(app, "GET", "/v1/models").json()["data"]]


def load(app: Any, name: str, path: Path | str, **kwargs: Any) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return call(app, "POST", "/v1/load_lora_adapter", json=body, **kwargs)


def unload(app: Any, name: str, **kwargs: Any) -> httpx.Response:
    return call(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": name}, **kwargs)


# -- choosing an adapter by `model` ---------------------------------------------------------------------------


def test_models_list_each_adapter_with_its_directory_and_parent(
    app: Any, tiny_lora_adapters: dict[str, Path]
) -> None:
    base, sql = call(app, "GET", "/v1/models").json()["data"]
    assert base["id"] == "tiny" and base["parent"] is None
    assert sql["id"] == "sql" and sql["object"] == "model"
    assert sql["root"] == str(tiny_lora_adapters["sql"]) and sql["parent"] == "tiny"


def test_completion_and_chat_by_adapter_name_match_the_offline_engine(
    app: Any, lora_engine: AsyncEngine, offline: Any
) -> None:
    texts = {}
    for model in ("tiny", "sql"):
        body = {"model": model, "prompt": PROMPT, **GREEDY}
        answer = call(app, "POST", "/v1/completions", json=body).json()
        assert answer["model"] == model
        texts[model] = answer["choices"][0]["text"]
        assert texts[model] == offline(PROMPT, None if model == "tiny" else "sql")
    assert texts["sql"] != texts["tiny"]

    reference = offline(chat_prompt(lora_engine), "sql")
    answer = call(
        app, "POST", "/v1/chat/completions", json={"model": "sql", "messages": USER, **GREEDY}
    ).json()
    assert answer["model"] == "sql" and answer["choices"][0]["message"]["content"] == reference
    assert reference != offline(chat_prompt(lora_engine), None)

    stream = {"model": "sql", "messages": USER, "stream": True, **GREEDY}
    events = sse_events(call(app, "POST", "/v1/chat/completions", json=stream))
    assert {e["model"] for e in events} == {"sql"}
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == reference


def test_metrics_show_the_adapters(app: Any) -> None:
    body = {"model": "sql", "prompt": PROMPT, **GREEDY}
    assert call(app, "POST", "/v1/completions", json=body).status_code == 200
    text = call(app, "GET", "/metrics").text
    assert (
        'structgen_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.0'
        in text
    )
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["structgen_lora_adapters_registered"]) >= 1
    assert float(lines["structgen_lora_slot_loads_total"]) >= 1
    assert "structgen_lora_evictions_total" in lines


def test_responses_by_adapter_name(app: Any, lora_engine: AsyncEngine, offline: Any) -> None:
    body = {"model": "sql", "input": USER[0]["content"], "max_output_tokens": 6, "temperature": 0}
    response = call(app, "POST", "/v1/responses", json=body | {"ignore_eos": True})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["model"] == "sql"
    assert data["output"][-1]["content"][0]["text"] == offline(chat_prompt(lora_engine), "sql")


def test_an_unknown_model_is_still_model_not_found(app: Any) -> None:
    for path, body in (
        ("/v1/completions", {"model": "nope", "prompt": PROMPT}),
        ("/v1/chat/completions", {"model": "nope", "messages": USER}),
    ):
        error = assert_error(call(app, "POST", path, json=body), 404, "'nope' does not exist", "'sql'")
        assert error["code"] == "model_not_found" and error["param"] == "model"
    response = call(app, "POST", "/v1/responses", json={"model": "nope", "input": "hi"})
    assert assert_error(response, 404, "'nope'")["code"] == "model_not_found"
    # An adapter shares the base model's tokenizer: /tokenize takes its name too.
    assert call(app, "POST", "/tokenize", json={"model": "sql", "prompt": PROMPT}).status_code == 200
    assert_error(call(app, "POST", "/tokenize", json={"model": "nope", "prompt": PROMPT}), 404)


def test_an_adapter_unloaded_before_its_request_reaches_the_engine_is_model_not_found(
    app: Any, lora_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The route still saw "ghost" (as a request does that was routed just before an unload), the engine does not:
    # the request is refused, not run on the base model nor loaded again from a path.
    ghost = SimpleNamespace(name="ghost", request=LoRARequest("ghost", 9))
    monkeypatch.setattr(lora_engine, "get_lora", lambda name: ghost if name == "ghost" else None)
    body = {"model": "ghost", "prompt": PROMPT, "max_tokens": 2}
    error = assert_error(
        call(app, "POST", "/v1/completions", json=body), 404, "no LoRA adapter named 'ghost'"
    )
    assert (error["code"], error["param"]) == ("model_not_found", "model")


# -- loading and unloading at run time ------------------------------------------------------------------------


def test_load_use_unload(app: Any, offline: Any, tiny_lora_adapters: dict[str, Path]) -> None:
    loaded = load(app, "poet", tiny_lora_adapters["poet"])
    assert loaded.status_code == 200 and loaded.headers["content-type"].startswith("text/plain")
    assert loaded.text == "Success: LoRA adapter 'poet' added successfully."
    assert model_ids(app) == ["tiny", "sql", "poet"]
    body = {"model": "poet", "prompt": PROMPT, **GREEDY}
    answer = call(app, "POST", "/v1/completions", json=body).json()
    assert answer["model"] == "poet" and answer["choices"][0]["text"] == offline(PROMPT, "poet")
    again = load(app, "poet", tiny_lora_adapters["poet"])  # the same name and path: nothing to do
    assert again.status_code == 200 and "already loaded" in again.text

    removed = unload(app, "poet")
    assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'poet' removed successfully."
    assert model_ids(app) == ["tiny", "sql"]
    error = assert_error(call(app, "POST", "/v1/completions", json=body), 404, "'poet' does not exist")
    assert error["code"] == "model_not_found"


def _broken(
    src: Path, dst: Path, *, config: str | None = None, rename: tuple[str, str] | None = None
) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "adapter_config.json").write_text(config)
    if rename is not None:
        weights = dst / "adapter_model.safetensors"
        tensors = load_file(str(weights))
        save_file({k.replace(*rename): v for k, v in tensors.items()}, str(weights))
    return dst


def test_load_refusals(app: Any, tiny_lora_adapters: dict[str, Path], tmp_path: Path) -> None:
    from lora.peft_adapters import make_peft_adapter

    from structgen.models.registry import resolve_model

    sql = tiny_lora_adapters["sql"]
    truncated = _broken(sql, tmp_path / "truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    high_rank = make_peft_adapter(
        resolve_model("tiny"), tmp_path / "r16", r=16, target_modules=["q_proj"], lora_alpha=16, seed=3
    )
    cases = [
        # (name, path, status, code, words in the message)
        ("a", tmp_path / "missing", 404, "lora_not_found", ["no LoRA adapter directory"]),
        ("a", tmp_path, 404, "lora_not_found", ["no adapter_config.json"]),
        (
            "a",
            _broken(sql, tmp_path / "json", config="{oops"),
            400,
            "invalid_lora_adapter",
            ["not valid JSON"],
        ),
        ("a", high_rank, 400, "invalid_lora_adapter", ["rank 16", f"max_lora_rank {MAX_LORA_RANK}"]),
        (
            "a",
            _broken(sql, tmp_path / "foreign", rename=("q_proj", "w_proj")),
            400,
            "invalid_lora_adapter",
            ["'w_proj', which the model does not have"],
        ),
        ("a", truncated, 400, "invalid_lora_adapter", ["cannot read the adapter weights"]),
        ("sql", tiny_lora_adapters["poet"], 400, "lora_name_taken", ["'sql' is already loaded"]),
        ("tiny", sql, 400, "lora_name_taken", ["base model"]),
        (" ", sql, 400, "invalid_value", ["lora_name must not be empty"]),
        ("a", "", 400, "invalid_value", ["lora_path must not be empty"]),
    ]
    for name, path, status, code, words in cases:
        error = assert_error(load(app, name, path), status, *words)
        assert error["code"] == code, (name, path, error)
        assert error["param"] in ("lora_name", "lora_path")
    for body in ({"lora_name": "a"}, {"lora_path": str(sql)}, {"lora_name": 1, "lora_path": str(sql)}):
        assert (
            assert_error(call(app, "POST", "/v1/load_lora_adapter", json=body), 400)["code"]
            == "invalid_request"
        )
    assert model_ids(app) == ["tiny", "sql"]


def test_load_beyond_max_cpu_loras_is_refused(
    app: Any, lora_engine: AsyncEngine, tiny_lora_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lora_engine.engine.lora.config, "max_cpu_loras", 1)  # type: ignore[union-attr]
    error = assert_error(
        load(app, "poet", tiny_lora_adapters["poet"]), 400, "1 LoRA adapters are loaded already"
    )
    assert error["code"] == "too_many_loras"
    assert model_ids(app) == ["tiny", "sql"]


def test_unload_refusals(app: Any) -> None:
    error = assert_error(unload(app, "nope"), 404, "no LoRA adapter named 'nope'")
    assert error["code"] == "lora_not_found" and error["param"] == "lora_name"
    assert_error(unload(app, "tiny"), 400, "base model")
    assert (
        assert_error(call(app, "POST", "/v1/unload_lora_adapter", json={}), 400)["code"] == "invalid_request"
    )
    assert_error(unload(app, ""), 400, "lora_name must not be empty")


def test_lora_routes_need_the_key(app: Any, tiny_lora_adapters: dict[str, Path]) -> None:
    for headers in (None, {"Authorization": "Bearer wrong"}):
        assert_error(load(app, "poet", tiny_lora_adapters["poet"], headers=headers), 401, "API key")
        assert_error(unload(app, "sql", headers=headers), 401, "API key")
    assert model_ids(app) == ["tiny", "sql"]


def test_a_server_without_lora_refuses_to_load(
    engine: AsyncEngine, tiny_lora_adapters: dict[str, Path]
) -> None:
    plain = build_app(engine, engine.engine.tokenizer, model_name="tiny", api_key=KEY)
    for response in (load(plain, "sql", tiny_lora_adapters["sql"]), unload(plain, "sql")):
        assert assert_error(response, 400, "--enable-lora")["code"] == "lora_not_enabled"
    assert model_ids(plain) == ["tiny"]


# -- the official SDK over a real socket ----------------------------------------------------------------------


def test_openai_sdk_by_adapter_name_and_unload_mid_stream(
    lora_engine: AsyncEngine, offline: Any, tiny_lora_adapters: dict[str, Path]
) -> None:
    served = build_app(lora_engine, lora_engine.engine.tokenizer, model_name="tiny", api_key=KEY)
    with serve(served) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        listed = {m.id: m for m in client.models.list()}
        assert set(listed) == {"tiny", "sql"} and listed["sql"].model_extra["parent"] == "tiny"  # type: ignore[index]
        chat = client.chat.completions.create(model="sql", messages=USER, max_tokens=6, temperature=0)  # type: ignore[arg-type]
        assert chat.model == "sql"
        completion = client.completions.create(
            model="sql", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.model == "sql" and completion.choices[0].text == offline(PROMPT, "sql")

        # Unloading while a stream runs with the adapter: the stream finishes with it, new requests get 404.
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as http:
            body = {"lora_name": "poet", "lora_path": str(tiny_lora_adapters["poet"])}
            assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
            stream = client.completions.create(
                model="poet",
                prompt=PROMPT,
                max_tokens=40,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = iter(stream)
            text = next(chunks).choices[0].text
            removed = http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
            assert removed.status_code == 200, removed.text
            text += "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == offline(PROMPT, "poet", 40)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="poet", prompt=PROMPT, max_tokens=2)
    wait_idle(lora_engine)
