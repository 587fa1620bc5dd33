"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: at the root, not under `/v1` (they are no
OpenAI API), behind the same API key as every route but `/health`.

`/tokenize` takes a text (`prompt`, special tokens added by default) or a conversation (`messages`, rendered
exactly as the chat route renders it: same tool rendering, same template, no special tokens added on top by
default) and answers `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` turns ids back into text.
`max_model_len` is the longest sequence (prompt and output) this engine can hold: the model's context, or less
where the KV cache is smaller, the limit a prompt is checked against.

The handlers are plain functions, which FastAPI runs on its thread pool: tokenizing a 16 MB body must not hold
up the event loop that streams every other answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from structgen.sampling_params import SamplingParams
from structgen.server import protocol as p
from structgen.server.chat_prompt import chat_prompt
from structgen.server.context import ServerContext
from structgen.server.errors import APIError
from structgen.server.protocol import _Request as _Body  # chat's strict request config, shared on purpose
from structgen.server.routes_models import resolve_model

# Fields of the conversation form only; a `prompt` request naming one is refused rather than quietly
# counted without it.
_MESSAGES_ONLY = (
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
)


class TokenizeRequest(_Body):
    """vLLM's two request forms in one body: `prompt` or `messages`, never both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = Field(default=None, min_length=1)
    # Unset: true for a prompt, false for messages (the chat template writes them itself), as vLLM has it.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    # Not in vLLM's request, but part of what the chat route renders: with "none" the tools stay out of the
    # prompt, so a chat request's exact prompt can be counted.
    tool_choice: str | dict[str, Any] | None = None
    # Extra chat template variables, as the chat route takes them (`{"enable_thinking": false}`).
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def add_tokenize_routes(router: APIRouter, ctx: ServerContext) -> None:
    tokenizer = ctx.tokenizer

    @router.post("/tokenize")
    def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        resolve_model(ctx, body.model)  # an adapter shares the base model's tokenizer
        token_ids = _conversation_ids(ctx, body) if body.messages is not None else _prompt_ids(ctx, body)
        return TokenizeResponse(
            count=len(token_ids),
            max_model_len=ctx.engine.engine.max_sequence_tokens,
            tokens=token_ids,
            token_strs=[tokenizer.id_to_token(i) for i in token_ids] if body.return_token_strs else None,
        )

    @router.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        resolve_model(ctx, body.model)  # an adapter shares the base model's tokenizer
        size = tokenizer.vocab_size
        for i, token_id in enumerate(body.tokens):
            if not 0 <= token_id < size:
                raise APIError(
                    400,
                    f"tokens[{i}]: token id {token_id} is outside the vocabulary (ids 0 to {size - 1})",
                    param="tokens",
                    code="invalid_value",
                )
        # Special tokens kept, as vLLM does: the text of a tokenized conversation comes back whole.
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


def _prompt_ids(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
    if body.prompt is None:
        raise APIError(400, "give either prompt (a text) or messages (a conversation)", param="prompt")
    for name in _MESSAGES_ONLY:
        if name in body.model_fields_set:
            raise APIError(400, f"{name} applies to messages, not to a prompt", param=name)
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    return ctx.tokenizer.encode(body.prompt, add_special_tokens=add_special)


def _conversation_ids(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        raise APIError(400, "give either prompt or messages, not both", param="prompt")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt "
            "to false to continue the final message)",
            param="continue_final_message",
        )
    # The chat route's own request, so its checks (tools, tool_choice) and its rendering apply unchanged.
    chat = p.ChatCompletionRequest(
        messages=body.messages,
        tools=body.tools,
        tool_choice=body.tool_choice,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    prompt = chat_prompt(
        ctx.tokenizer,
        chat,
        SamplingParams(),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=bool(body.add_special_tokens),
    )
    return prompt.token_ids
