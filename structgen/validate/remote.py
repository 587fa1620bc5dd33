"""The server runner: the same corpus through a running `structgen serve` (or any OpenAI-compatible server)
with `response_format: json_schema`, `concurrency` requests in flight. A server does not say how it compiled,
so compile times and grammar-vs-labels are not measured here; a 400 naming a keyword counts as unsupported."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

from structgen.validate.checks import GenerationOptions, build_prompt, judge, schema_problem
from structgen.validate.corpus import SchemaCase
from structgen.validate.local import Emit
from structgen.validate.records import SampleRecord, SchemaRecord

_KEYWORD = re.compile(r"keyword '([^']+)'")


class ServerError(Exception):
    """The server cannot be used at all (unreachable, wrong API key): the run stops."""


class RemoteRunner:
    def __init__(
        self,
        base_url: str,
        options: GenerationOptions,
        *,
        concurrency: int,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.options = options
        self.concurrency = concurrency
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def run(self, cases: Sequence[SchemaCase], emit: Emit) -> None:
        asyncio.run(self._run(cases, emit))

    async def _run(self, cases: Sequence[SchemaCase], emit: Emit) -> None:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(headers=self.headers, timeout=self.timeout_s, limits=limits) as client:
            model = await self._model(client)
            gate = asyncio.Semaphore(self.concurrency)

            async def one(case: SchemaCase) -> None:
                async with gate:
                    record, samples = await self._case(client, model, case)
                emit(record, samples)

            await asyncio.gather(*(one(case) for case in cases))

    async def _model(self, client: Any) -> str:
        import httpx

        try:
            response = await client.get(f"{self.base_url}/models")
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.base_url}: {e}") from None
        if response.status_code != 200:
            raise ServerError(f"{self.base_url}/models answered {response.status_code}: {_message(response)}")
        models = response.json().get("data") or []
        if not models:
            raise ServerError(f"{self.base_url}/models lists no model")
        return str(models[0]["id"])

    async def _case(
        self, client: Any, model: str, case: SchemaCase
    ) -> tuple[SchemaRecord, list[SampleRecord]]:
        import httpx

        problem = schema_problem(case.schema)
        if problem is not None:
            return SchemaRecord(case.id, case.subset, "invalid_schema", error=problem), []
        body = {
            "model": model,
            "messages": [{"role": "user", "content": build_prompt(self.options, case.schema)}],
            "n": self.options.samples,
            "max_tokens": self.options.max_tokens,
            "temperature": self.options.temperature,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "schema", "schema": case.schema},
            },
        }
        if self.options.seed is not None:
            body["seed"] = self.options.seed
        start = time.monotonic()
        try:
            response = await client.post(f"{self.base_url}/chat/completions", json=body)
        except httpx.HTTPError as e:
            return SchemaRecord(case.id, case.subset, "error", error=f"request failed: {e!r}"), []
        latency = time.monotonic() - start
        if response.status_code in (401, 403):
            raise ServerError(
                f"the server refused the request ({response.status_code}): {_message(response)}"
            )
        if response.status_code != 200:
            return _refused(case, response), []
        data = response.json()
        choices = data.get("choices") or []
        tokens = (data.get("usage") or {}).get("completion_tokens", 0) // max(1, len(choices))
        samples = []
        for i, choice in enumerate(choices):
            text = (choice.get("message") or {}).get("content") or ""
            status, error = judge(choice.get("finish_reason"), text, case.schema, None)
            samples.append(
                SampleRecord(
                    case.id, case.subset, i, status, choice.get("finish_reason"), text, tokens, latency, error
                )
            )
        return SchemaRecord(case.id, case.subset, "compiled"), samples


def _refused(case: SchemaCase, response: Any) -> SchemaRecord:
    message = _message(response)
    code = _error(response).get("code")
    if code == "unsupported_schema":
        match = _KEYWORD.search(message)
        return SchemaRecord(
            case.id, case.subset, "unsupported", keyword=match.group(1) if match else None, error=message
        )
    status = "timeout" if code == "compile_timeout" else "error"
    return SchemaRecord(case.id, case.subset, status, error=f"HTTP {response.status_code}: {message}")


def _error(response: Any) -> dict[str, Any]:
    try:
        error = response.json().get("error")
    except ValueError:
        return {}
    return error if isinstance(error, dict) else {}


def _message(response: Any) -> str:
    return str(_error(response).get("message") or response.text[:200])
