"""What the engine hands back: one `RequestOutput` per request, one `CompletionOutput` per sample (vLLM's shape).

Fields are cumulative (`text`, `token_ids` so far); `delta_text` / `delta_token_ids` hold what is new since the
previous output of the same request, which is what a stream sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from structgen.engine.metrics import RequestMetrics


@dataclass(slots=True)
class TokenLogprob:
    """The log-probability of one token (sampled, or a prompt token given those before it), and the `logprobs`
    (or `prompt_logprobs`) most likely alternatives at that position. `rank`: the token's place in the model's
    distribution there (1 = most likely), known for prompt tokens."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class StructuredReport:
    """How a structured request's output was produced and checked.

    `valid` is None until the output finishes; `complete` is False when `max_tokens` cut it short (it is then
    not valid). `path` is the serving path (exact / rewritten / relaxed), `retries` the resamples a relaxed
    grammar needed, `forced_tokens` the tokens appended by jump-forward. `closed_at_budget`: the tokens left
    ran down to what the grammar needed to finish, so the output was steered onto its shortest valid completion
    (it finished "stop" where it would have been cut); `loops_ended`: values the loop guard ended because the
    model kept repeating the same tokens in them.
    """

    backend: str | None
    path: str | None
    valid: bool | None
    complete: bool
    error: str | None = None
    retries: int = 0
    forced_tokens: int = 0
    changes: list[str] = field(default_factory=list)
    closed_at_budget: bool = False
    loops_ended: int = 0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    # What stopped it: the stop string or stop token id; None for EOS, length, or still running.
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None  # only when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Why the request failed when `finish_reason == "error"` (a grammar that cannot compile...).
    error: str | None = None
    error_code: str | None = (
        None  # its kind when the engine knows it ("compile_timeout", "unsupported_schema")
    )
    # For structured requests: how it was served and whether the output validates (`StructuredReport`).
    structured: StructuredReport | None = None
    # With a reasoning parser: the reasoning the model wrote before its answer (markers left out; None when the
    # output has no reasoning phase), what is new of it since the last output, and the output tokens spent before
    # the answer (markers included). `text` / `delta_text` then hold the answer alone.
    reasoning: str | None = None
    delta_reasoning: str = ""
    num_reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With `SamplingParams.prompt_logprobs`: one entry per prompt token, None for the first (nothing precedes
    # it); set once the whole prompt has run, on every output from then on. None when not asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __repr__(self) -> str:
        texts = [(o.index, o.text, o.finish_reason) for o in self.outputs]
        return f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, outputs={texts})"
