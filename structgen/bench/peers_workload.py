"""What `structgen bench peers` asks every server: the prompts, the JSON schemas, the async httpx client that
sends them to any OpenAI-compatible server, and the counting of its answers (the phases are in `peers.py`)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Short notes an extraction prompt asks about, by kind; each kind has its schema in SCHEMAS.
_NOTES: dict[str, tuple[str, ...]] = {
    "person": (
        "Maria Santos is 34 years old and lives in Lisbon, where she works as a marine biologist. "
        "She speaks Portuguese, English and a little Japanese.",
        "Our new hire, Tomasz Nowak (41), moved from Krakow to Dublin last spring. He is a backend "
        "engineer and is fluent in Polish and English.",
        "Aisha Bello, a 27-year-old pediatric nurse from Lagos, volunteers at weekends. She speaks "
        "Yoruba, Hausa and English.",
        "At 68, retired schoolteacher Henrik Larsen still guides hikers around Bergen. He speaks "
        "Norwegian, German and English.",
    ),
    "event": (
        "The quarterly planning meeting is on 2025-03-14 and runs for 90 minutes. Attending: Priya, "
        "Jonas, Mei and the finance lead, Carlos.",
        "Reminder: the Rust workshop takes place on 2024-11-02, a full 240-minute session led by "
        "Ana and Dmitri, with Leila assisting.",
        "Sam's surprise birthday party is 2025-07-19 at the lake house, about three hours long. "
        "Invited so far: Jordan, Taylor, Alex and Morgan.",
        "The European Data Conference opens on 2026-05-06; the keynote slot lasts 45 minutes and "
        "features Dr. Okafor and Prof. Lindqvist.",
    ),
    "order": (
        "Order KTR-4821 from Jamal Wright: 3 items (a desk lamp, two USB-C cables, a mouse pad). "
        "Payment cleared and the parcel left the warehouse this morning.",
        "Customer Elena Petrova placed order BXM-0097 for 12 bags of espresso beans and a grinder. "
        "It is still waiting for payment confirmation.",
        "Order ZQA-3310 (buyer: Hiro Tanaka) contained 1 road bike and 2 helmets; it was delivered "
        "to the front desk on Tuesday.",
        "Please note order PLN-7745 by Grace Kim for 5 notebooks and a fountain pen was cancelled "
        "at the customer's request.",
    ),
    "product": (
        "The Aurora X2 noise-cancelling headphones by Sonique cost $199.99. Reviewers call them "
        "light, wireless and great for travel.",
        "Brewmaster's 1.7-litre stainless steel kettle, model K17, sells for $49.50 and boils "
        "water in under four minutes; it is cordless and quiet.",
        "TrailPeak's two-person tent weighs 1.9 kg, is waterproof to 3000 mm and costs $329.00. "
        "It packs small and sets up in five minutes.",
        "'The Quiet Orbit', a hardcover science-fiction novel from Halcyon Press, is $24.95; "
        "critics praise its pacing and its ending.",
    ),
}
# (kind, text), the kinds interleaved: any run of consecutive requests mixes the schemas.
TEXTS: tuple[tuple[str, str], ...] = tuple(
    (kind, notes[j]) for j in range(4) for kind, notes in _NOTES.items()
)

_NAME = {"type": "string", "minLength": 1, "maxLength": 48}
_WORDS = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 32}, "maxItems": 6}


def _strict(properties: dict[str, Any]) -> dict[str, Any]:
    # OpenAI's `strict: true` wants every property required and no others allowed.
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


# Small, and bounded (maxLength, maxItems) so a 135M model's greedy answer fits in 192 tokens: the point is
# the cost of enforcing them, not whether the model rambles. Every keyword is one all three servers enforce.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _strict(
        {
            "name": _NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": _NAME,
            "occupation": _NAME,
            "languages": _WORDS,
        }
    ),
    "event": _strict(
        {
            "title": _NAME,
            "kind": {"type": "string", "enum": ["meeting", "workshop", "party", "conference", "other"]},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "duration_minutes": {"type": "integer", "minimum": 0, "maximum": 1440},
            "attendees": _WORDS,
        }
    ),
    "order": _strict(
        {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "customer": _NAME,
            "items": _WORDS,
            "quantity": {"type": "integer", "minimum": 0, "maximum": 1000},
            "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        }
    ),
    "product": _strict(
        {
            "name": _NAME,
            "brand": _NAME,
            "price_cents": {"type": "integer", "minimum": 0},
            "category": {"type": "string", "enum": ["electronics", "kitchen", "outdoor", "books", "other"]},
            "tags": _WORDS,
        }
    ),
}

_WHAT = {
    "person": "the person's details",
    "event": "the event's details",
    "order": "the order",
    "product": "the product's details",
}
_EXTRACT = (
    "Extract {what} from the text below as JSON with the fields {fields}.\n\nText: {text}",
    "Read this note and return {what} as a JSON object ({fields}).\n\n{text}",
    "{text}\n\nGive {what} above as JSON. Fields: {fields}.",
    "From the following message, pull out {what} as JSON ({fields}).\n\nMessage: {text}",
)
_FREE = (
    "Write a long, detailed story that begins with this note: {text}",
    "Continue the following text for several paragraphs: {text}",
    "Describe in depth everything that could happen next: {text}",
    "Write a long letter to a friend about this: {text}",
)


@dataclass(frozen=True, slots=True)
class Extraction:
    kind: str  # a key of SCHEMAS
    messages: list[dict[str, str]]


def _variants(templates: tuple[str, ...], n: int) -> list[tuple[str, str, str]]:
    """`n` (kind, text, template) picks: every text under every template before any repeats, then the same
    again tagged with a request number so that no two prompts are ever equal."""
    picks = []
    for i in range(n):
        kind, text = TEXTS[i % len(TEXTS)]
        template = templates[(i // len(TEXTS)) % len(templates)]
        if i >= len(TEXTS) * len(templates):
            text = f"{text} (request {i})"
        picks.append((kind, text, template))
    return picks


def extraction_requests(n: int) -> list[Extraction]:
    out = []
    for kind, text, template in _variants(_EXTRACT, n):
        fields = ", ".join(SCHEMAS[kind]["properties"])
        content = template.format(what=_WHAT[kind], fields=fields, text=text)
        out.append(Extraction(kind=kind, messages=[{"role": "user", "content": content}]))
    return out


def free_requests(n: int, *, offset: int = 0) -> list[list[dict[str, str]]]:
    """`n` distinct chat prompts for free decoding; `offset` starts further along the same sequence."""
    picks = _variants(_FREE, n + offset)[offset:]
    return [[{"role": "user", "content": template.format(text=text)}] for _, text, template in picks]


# SmolLM2's BPE averages ~3.3 characters a token on the notes' sentences (names and digits split finely;
# counted with its tokenizer.json). The servers report the real count (`prompt_tokens`); llama.cpp's slots hold
# 1,024 tokens, prompt and answer together, so the estimate errs low.
_CHARS_PER_TOKEN = 3.15


def long_prompt(rng: random.Random, approx_tokens: int) -> str:
    """A ~`approx_tokens`-token prompt that no server has seen: a random session tag first (prefix caches
    match from the first token), then the notes' sentences, each round a fresh shuffle of all of them (drawing
    every sentence equally keeps the token count steady, +-3%, where picking at random swings it +-8%)."""
    sentences = [s.strip().rstrip(".") + "." for _, text in TEXTS for s in text.split(". ") if s.strip()]
    parts = [f"Session {rng.getrandbits(64):016x}. Below are unrelated notes."]
    size, budget = len(parts[0]), approx_tokens * _CHARS_PER_TOKEN
    while size < budget:
        for line in rng.sample(sentences, len(sentences)):
            if size >= budget:
                break
            parts.append(line)
            size += len(line) + 1
    parts.append("Summarize the notes above in one sentence:")
    return "\n".join(parts)


# -- results --------------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Reply:
    """One non-streamed answer (or why there is none)."""

    status: int | None  # None: no HTTP response (a transport error)
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


@dataclass(slots=True, kw_only=True)
class Throughput:
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    errors: int
    first_error: str | None = None


@dataclass(slots=True, kw_only=True)
class Structured:
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    finished: int  # finish_reason == "stop"
    valid: int  # finished and validating against its schema
    invalid: int  # finished but not JSON, or not matching its schema: must be 0
    errors: int  # no 200 answer
    invalid_examples: list[dict[str, str]] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)  # the first finished output per schema, to read
    first_error: str | None = None


@dataclass(slots=True, kw_only=True)
class Ttft:
    median_ms: float | None  # None: no sample succeeded
    samples_ms: list[float]
    prompt_tokens: list[int | None]  # as each server reports it (`usage`), None where it does not
    errors: list[str] = field(default_factory=list)


def count_structured(items: list[Extraction], replies: list[Reply], wall_s: float) -> Structured:
    """Finished / valid / invalid counts of `replies` (in the order of `items`), each checked against its own
    schema with jsonschema."""
    import jsonschema

    finished = valid = 0
    examples: list[dict[str, str]] = []
    samples: dict[str, str] = {}
    for item, reply in zip(items, replies, strict=True):
        if reply.status != 200 or reply.finish_reason != "stop":
            continue
        finished += 1
        samples.setdefault(item.kind, reply.text)
        try:
            jsonschema.validate(json.loads(reply.text), SCHEMAS[item.kind])
        except (ValueError, jsonschema.ValidationError) as error:  # json's errors are ValueErrors
            examples.append({"schema": item.kind, "text": reply.text, "error": str(error).split("\n")[0]})
            continue
        valid += 1
    errors = [r for r in replies if r.status != 200]
    tokens = sum(r.completion_tokens for r in replies)
    return Structured(
        requests=len(replies),
        tokens=tokens,
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        finished=finished,
        valid=valid,
        invalid=finished - valid,
        errors=len(errors),
        invalid_examples=examples[:5],
        samples=samples,
        first_error=errors[0].error if errors else None,
    )


def throughput(replies: list[Reply], wall_s: float) -> Throughput:
    errors = [r for r in replies if r.status != 200]
    tokens = sum(r.completion_tokens for r in replies)
    return Throughput(
        requests=len(replies),
        tokens=tokens,
        wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        errors=len(errors),
        first_error=errors[0].error if errors else None,
    )


# -- the client -----------------------------------------------------------------------------------------------


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Reply:
    """POST a non-streamed request; a failure becomes a Reply with `error` set instead of an exception, so one
    bad answer does not lose the batch's numbers."""
    start = time.perf_counter()
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as error:
        return Reply(
            status=None, latency_s=time.perf_counter() - start, error=f"{type(error).__name__}: {error}"
        )
    latency = time.perf_counter() - start
    try:
        data = response.json()
    except ValueError:
        data = {}
    if response.status_code != 200 or "choices" not in data:
        message = (data.get("error") or {}).get("message") if isinstance(data.get("error"), dict) else None
        return Reply(
            status=response.status_code, latency_s=latency, error=message or response.text[:300] or "no body"
        )
    choice = data["choices"][0]
    usage = data.get("usage") or {}
    text = (choice.get("message") or {}).get("content") if "message" in choice else choice.get("text")
    return Reply(
        status=200,
        text=text or "",
        finish_reason=choice.get("finish_reason"),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        latency_s=latency,
    )


async def batch(
    client: httpx.AsyncClient, path: str, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[Reply], float]:
    """Every body with at most `concurrency` in flight; the replies in order and the wall time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> Reply:
        async with gate:
            return await post(client, path, body)

    start = time.perf_counter()
    replies = await asyncio.gather(*(one(b) for b in bodies))
    return list(replies), time.perf_counter() - start


async def first_token_s(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, int | None]:
    """Streams a completion: seconds until the first event carrying text or a finish reason (a role-only first
    chunk does not count), and the prompt's token count when the server reports usage."""
    start = time.perf_counter()
    first: float | None = None
    prompt_tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            choices = event.get("choices") or [{}]
            if first is None and (choices[0].get("text") or choices[0].get("finish_reason")):
                first = time.perf_counter() - start
            if event.get("usage"):
                prompt_tokens = event["usage"].get("prompt_tokens")
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first, prompt_tokens
