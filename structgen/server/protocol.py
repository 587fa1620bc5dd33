"""Request bodies of the OpenAI API (plus vLLM's extra request fields), as pydantic models; the response bodies
are in `answers.py`.

Requests ignore unknown fields, as OpenAI does; each knows how to become `SamplingParams` so the routes stay
about HTTP.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from structgen.sampling_params import SamplingParams
from structgen.server.errors import APIError
from structgen.server.structured_request import resolve_structured, structured_options

# OpenAI's ranges for the HTTP API, checked before any work starts. The offline `SamplingParams` keeps vLLM's
# wider ones (any temperature >= 0, any n), which scripts may rely on.
MAX_TEMPERATURE = 2.0
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's own limit
MAX_PROMPT_LOGPROBS = 20  # vLLM's `prompt_logprobs`, held to the engine's limit (`SamplingParams`)
# OpenAI's default `max_tokens` for text completions (chat has none: the server's `max_tokens_default` caps it).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI does. Known ones are typed strictly, also as OpenAI does:
    # `"stream": "yes"` or `"n": "2"` is a 400, not coerced (an int still passes for a float); NaN and
    # infinities are no numbers.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingExtras(_Request):
    """Sampling fields every generation route takes, the Responses API included (where OpenAI has no such field,
    they are vLLM's): seed, stop, penalties, vLLM's sampling extras and structured-output fields."""

    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # vLLM's extras, sent by the `openai` SDK as top-level fields through `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class _SamplingFields(SamplingExtras):
    """Fields shared by chat and text completions: OpenAI's sampling options (and, inherited, vLLM's extras)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: the logprob of each prompt token given those before it, with this many alternatives per position,
    # answered in vLLM's shape (`logprobs_body.vllm_prompt_logprobs`). Not streamed, as in vLLM.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)

    def structured_options(self) -> dict[str, Any]:
        """The options of `structured_outputs` (budget closing, loop guard, whitespace, strict), checked."""
        return structured_options(self.structured_outputs)

    def _structured(self, response_format: dict[str, Any] | None, *, has_tools: bool) -> Any:
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        return resolve_structured(
            response_format=response_format,
            guided=guided,
            structured_outputs=self.structured_outputs,
            has_tools=has_tools,
        )

    def _sampling_params(
        self,
        max_tokens: int | None,
        response_format: dict[str, Any] | None,
        logprobs: int | None,
        *,
        prompt_logprobs: int | None = None,
        has_tools: bool = False,
        thinking_token_budget: int | None = None,
    ) -> SamplingParams:
        """The engine's view of this request; a bad value is a 400 that names the field. `prompt_logprobs`: what
        the engine computes for the prompt (the request's own field, or more for completions' `echo`)."""
        if self.stream and self.prompt_logprobs is not None:
            # vLLM's refusal: a stream has no place for them (its chunks carry no prompt_logprobs field).
            raise APIError(
                400, "prompt_logprobs is not available when stream is enabled", param="prompt_logprobs"
            )
        try:
            optional = {
                "temperature": self.temperature,
                "top_p": self.top_p,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "top_k": self.top_k,
                "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
            }
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                seed=self.seed,
                stop=self.stop,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                min_tokens=self.min_tokens,
                structured_outputs=self._structured(response_format, has_tools=has_tools),
                thinking_token_budget=thinking_token_budget,
                **{k: v for k, v in optional.items() if v is not None},
            )
        except APIError:
            raise
        except ValueError as error:  # SamplingParams' messages start with the field's name
            raise APIError(400, str(error), param=self._param_of(error), code="invalid_value") from None

    def _param_of(self, error: ValueError) -> str | None:
        head = str(error).split(" ", 1)[0]
        return head if head in type(self).model_fields else None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier assistant turn's reasoning, as vLLM (`reasoning`, `reasoning_content`) answers it: handed to the
    # chat template, which decides what of it the prompt keeps (Qwen3's drops it from turns before the last query).
    reasoning: str | None = None
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"only text content parts are supported, got {part.get('type')!r}",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = content or ""
        for key in ("name", "tool_calls", "tool_call_id"):
            if (value := getattr(self, key)) is not None:
                message[key] = value
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling (checked and applied by `structgen.server.tool_calls`).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (`serve --reasoning-parser`), in vLLM's terms: the most tokens the reasoning may take before
    # the answer is forced to start (unset: the server's `--thinking-token-budget`); keyword arguments for the
    # chat template (`{"enable_thinking": false}` turns Qwen3's reasoning off; checked in `chat_prompt`); and
    # whether the answer reports the reasoning (false: `reasoning` / `reasoning_content` stay null).
    thinking_token_budget: int | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True

    @property
    def max_tokens_given(self) -> bool:
        """Whether the request caps its output itself; if not, the server's default cap applies."""
        return self.max_completion_tokens is not None or self.max_tokens is not None

    def to_sampling_params(self) -> SamplingParams:
        """The params as the request gives them; without a max_tokens the route sets the server's cap, which
        depends on the prompt's length (`structgen.server.limits.with_default_max_tokens`)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        has_tools = self.tools is not None or self.tool_choice is not None
        return self._sampling_params(
            max_tokens,
            self.response_format,
            logprobs,
            prompt_logprobs=self.prompt_logprobs,
            has_tools=has_tools,
            thinking_token_budget=self.thinking_token_budget,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with `echo` (`scores_prompt_only`), as OpenAI's legacy API and vLLM allow.
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    @property
    def scores_prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the answer is the prompt and (with `logprobs`) its logprobs, nothing
        generated (how lm-evaluation-harness scores a text). See `echo.prompt_only`."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "max_tokens must be at least 1 (0 is allowed with echo only)", param="max_tokens"
            )
        # `null` is OpenAI's default too, never "until the context is full" (which vLLM reads it as).
        max_tokens = self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        if self.scores_prompt_only:
            max_tokens = 1  # the engine always generates: the route drops this token (`echo.prompt_only`)
        # Echoed tokens carry logprobs as the sampled ones do: the engine scores the prompt with enough
        # alternatives for both the legacy object and vLLM's `prompt_logprobs`.
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        prompt_logprobs = max(wanted) if wanted else None
        return self._sampling_params(max_tokens, None, self.logprobs, prompt_logprobs=prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(prompt)  # type: ignore[arg-type]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
