"""`GET /v1/models`, the model a request names, and vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter`
(`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`).

Each registered adapter is a model of its own: listed with its directory as `root` and the base model as
`parent`, and chosen by a request's `model`. Both LoRA routes answer 200 with vLLM's short plain-text message, and
an OpenAI error body otherwise: 404 for an adapter directory that is not there or an unload of a name no adapter
has, 400 for everything else (LoRA off, a blank field, an adapter the model cannot serve, a name in use).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from structgen.lora import LoRAError, LoRARequest
from structgen.server import answers as a
from structgen.server import protocol as p
from structgen.server.context import ServerContext
from structgen.server.errors import APIError


class LoadLoRAAdapterRequest(p._Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(p._Request):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; adapters are known by name here, so it is not needed


def resolve_model(ctx: ServerContext, requested: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names; None for the base model (its own name, or no `model` at all).
    404 `model_not_found` for a name this server does not serve."""
    if requested is None or requested == ctx.model_name:
        return None
    served = ctx.engine.get_lora(requested)
    if served is None:
        adapters = [s.name for s in ctx.engine.list_loras()]
        also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {ctx.model_name!r}{also}",
            param="model",
            code="model_not_found",
        )
    # By name, without a path: were the adapter unloaded before this request reaches the step thread, the
    # engine refuses it (404) instead of loading it from its directory again.
    return LoRARequest(served.name, served.request.lora_int_id)


def add_model_routes(router: APIRouter, ctx: ServerContext) -> None:
    engine = ctx.engine

    @router.get("/models")
    async def models() -> a.ModelList:
        cards = [a.ModelCard(id=ctx.model_name, root=ctx.model_name)]
        cards += [
            a.ModelCard(
                id=served.name,
                root=served.adapter.path,
                parent=served.request.base_model_name or ctx.model_name,
            )
            for served in engine.list_loras()
        ]
        return a.ModelList(data=cards)

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = _field(body.lora_name, "lora_name")
        path = _field(body.lora_path, "lora_path")
        _check_enabled(ctx)
        if name == ctx.model_name:
            raise APIError(
                400,
                f"{name!r} is the base model's name: choose another lora_name",
                param="lora_name",
                code="lora_name_taken",
            )
        # A name taken by another directory, or one adapter too many: the manager refuses it (LoRAError's code).
        existing = engine.get_lora(name)
        # vLLM's clients give no id; one no other adapter has keeps `lora_int_id` meaningful to those that read it.
        next_id = max((s.request.lora_int_id for s in engine.list_loras()), default=0) + 1
        request = LoRARequest(name, existing.request.lora_int_id if existing else next_id, path)
        try:
            await engine.add_lora(request)
        except LoRAError as error:
            raise _lora_error(error, param="lora_path") from None
        verb = "is already loaded" if existing is not None else "added successfully"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {verb}.")

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = _field(body.lora_name, "lora_name")
        _check_enabled(ctx)
        if name == ctx.model_name:
            raise APIError(
                400,
                f"{name!r} is the base model, not a LoRA adapter: it cannot be unloaded",
                param="lora_name",
            )
        try:
            await engine.remove_lora(name)
        except LoRAError as error:
            raise _lora_error(error, param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _field(value: str, name: str) -> str:
    if not value.strip():
        raise APIError(400, f"{name} must not be empty", param=name, code="invalid_value")
    return value


def _check_enabled(ctx: ServerContext) -> None:
    if not ctx.engine.lora_enabled:
        raise APIError(
            400,
            "LoRA adapters are not enabled on this server: start it with --enable-lora (or --lora-modules)",
            code="lora_not_enabled",
        )


def _lora_error(error: LoRAError, *, param: str) -> APIError:
    return APIError(error.status, str(error), param=param, code=error.code)
