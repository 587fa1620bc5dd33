"""A chat request's prompt: its tools rendered into the conversation (`ChatTools`), the chat template applied (with
the request's `chat_template_kwargs`), the text tokenized, as the chat route sends it to the engine. `/tokenize`
counts a conversation through this, so its count is the chat route's `usage.prompt_tokens` for the same messages,
tools and template arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from structgen.sampling_params import SamplingParams
from structgen.server import protocol as p
from structgen.server.errors import APIError
from structgen.server.tool_calls import ChatTools

# The variables the template gets from the request itself, and the renderer's own arguments and globals:
# `chat_template_kwargs` may add variables (`enable_thinking`...) but not replace these (nor the tokenizer's named
# special tokens, `bos_token`...), which would let a request render a conversation other than the one it sends.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "special_tokens",
        "raise_exception",
        "strftime_now",
    }
)


@dataclass(slots=True, frozen=True, kw_only=True)
class ChatPrompt:
    tools: ChatTools
    text: str
    token_ids: list[int]

    @property
    def engine_prompt(self) -> dict[str, Any]:
        """What `AsyncEngine.generate` takes: the text and its ids (the engine does not tokenize it again)."""
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def chat_prompt(
    tokenizer: Any,
    body: p.ChatCompletionRequest,
    params: SamplingParams,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> ChatPrompt:
    """The prompt of `body` (400 for tools or a conversation the template refuses). The chat route's is the
    default: the template opens the assistant's turn and writes any BOS itself, so none is added.
    `continue_final_message` ends the prompt inside the final message instead, for the model to go on with it."""
    template_kwargs = _template_kwargs(body.chat_template_kwargs, tokenizer)
    messages = [m.for_template() for m in body.messages]
    tools = ChatTools.from_request(body, tokenizer, messages, params)
    try:
        text = tokenizer.apply_chat_template(
            tools.messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools.template_tools,
            **template_kwargs,
        )
    except Exception as error:  # a template that rejects the conversation (roles out of order...)
        raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from None
    if continue_final_message:
        text = _open_final_message(text, tools.messages[-1].get("content"))
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ChatPrompt(tools=tools, text=text, token_ids=token_ids)


def _template_kwargs(kwargs: dict[str, Any] | None, tokenizer: Any) -> dict[str, Any]:
    """The request's extra template variables; 400 naming `chat_template_kwargs` for a reserved one."""
    reserved = RESERVED_TEMPLATE_KWARGS.union(getattr(tokenizer, "special_tokens", None) or ())
    clashes = sorted(reserved.intersection(kwargs or ()))
    if clashes:
        raise APIError(
            400,
            f"chat_template_kwargs cannot set {', '.join(map(repr, clashes))}: the server sets "
            f"{'it' if len(clashes) == 1 else 'them'} from the request itself (use the request's own fields)",
            param="chat_template_kwargs",
            code="invalid_value",
        )
    return dict(kwargs or {})


def _open_final_message(text: str, final: Any) -> str:
    """`text` cut right after the final message's content, dropping the end-of-turn the template wrote after it
    (transformers' `continue_final_message`). The content's trailing whitespace is kept where the template
    kept it."""
    content = final if isinstance(final, str) else ""
    stripped = content.strip()
    if not stripped or stripped not in text:
        raise APIError(
            400,
            "continue_final_message: the final message's content does not appear in the prompt the chat "
            "template renders (the message is empty, or the template changes it)",
            param="continue_final_message",
        )
    start = text.rindex(stripped)
    kept = content.lstrip()
    end = start + (len(kept) if text[start : start + len(kept)] == kept else len(stripped))
    return text[:end]
