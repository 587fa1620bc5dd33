"""What a background request would be refused for before its generation runs, checked before it is accepted.

A plain request that the chat pipeline refuses (a strict tool whose schema cannot be enforced, a conversation
the chat template rejects, a structured-output schema that does not compile) gets a 400; a background one must
too, on its POST, rather than a `queued` answer that turns `failed`. So the POST goes through the pipeline's
preparation (`routes_chat.run_chat` up to its dispatch: model, params, prompt, output cap), checks that the
prompt and its output fit the engine (its own rule) and compiles the request's grammar before it answers. The background task then prepares the request again (rendering the prompt a
second time, a small cost next to its generation) and finds the grammar in the compile cache.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from structgen.engine.async_engine import EngineDeadError
from structgen.engine.inputs import resolve_max_tokens
from structgen.server import protocol as p
from structgen.server.chat_prompt import chat_prompt
from structgen.server.context import ServerContext
from structgen.server.generation import start_errors
from structgen.server.limits import with_default_max_tokens
from structgen.server.routes_models import resolve_model

if TYPE_CHECKING:
    from structgen.structured import StructuredOutputsParams


async def check_prepared(ctx: ServerContext, body: p.ChatCompletionRequest) -> None:
    """Raise what `run_chat` would raise for `body` before its engine request runs (as `APIError`s in chat's
    terms, as `run_chat` raises them)."""
    resolve_model(ctx, body.model)
    params = body.to_sampling_params()
    prompt = chat_prompt(ctx.tokenizer, body, params)
    run_params = prompt.tools.params
    if not body.max_tokens_given:
        run_params = with_default_max_tokens(
            run_params,
            default=ctx.limits.max_tokens_default,
            prompt_tokens=len(prompt.token_ids),
            max_sequence_tokens=ctx.engine.engine.max_sequence_tokens,
        )
    engine = ctx.engine.engine
    with start_errors():  # as the engine request's start would raise them
        # The engine's own check of the prompt and its output against the context and the whole KV cache.
        resolve_max_tokens(
            len(prompt.token_ids),
            run_params.max_tokens,
            max_model_len=engine.max_model_len,
            num_blocks=engine.block_manager.num_blocks,
            block_size=engine.block_manager.block_size,
        )
        if run_params.structured_outputs is not None:
            await _compile(ctx, run_params.structured_outputs)


async def _compile(ctx: ServerContext, structured: StructuredOutputsParams) -> None:
    """Compile the grammar of `structured` with the engine's manager, whose cache the engine request finds it
    in. A failure that is not one of structgen's is what the engine reports as an unsupported schema."""
    from structgen.structured import StructuredOutputError, UnsupportedSchemaError

    outputs = getattr(ctx.engine.engine, "structured", None)
    if outputs is None:  # an engine without a structured-output layer: its own start reports the error
        return
    try:
        if outputs.manager is None:
            # Built by the step thread, as for the engine's own first structured request: built here as well,
            # at the same time, the engine could end up with two.
            await ctx.engine.on_step_thread(outputs.ensure_manager)
        spec = structured.to_spec()
        # Shielded: a POST whose client leaves must not cancel the compile, which the cache shares.
        await asyncio.shield(asyncio.wrap_future(outputs.manager.submit(spec)))
    except (StructuredOutputError, EngineDeadError):
        raise
    except Exception as error:
        raise UnsupportedSchemaError(str(error)) from None
