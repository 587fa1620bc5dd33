"""`structgen bench reasoning`: what the reasoning phase switch costs a structured request (issue 19).

Two engines on one loaded model (the weights are shared): one with a reasoning parser, one without. Every pass
runs `--batch` JSON-schema requests (temperature 1, `--max-tokens` each) to completion on one side; the sides
alternate in ABBA order (A B, B A, A B, ...) so that drift of a shared CPU hits both alike, and each side sums
the time of its own `engine.step()` calls. Pass k of either side sends the same requests: the same prompts
(tagged k, so that no pass reads another's prompts from the prefix cache) and the same seeds.

- reasoning: the output reasons freely for `--budget` tokens (`thinking_token_budget`), then `</think>` is
  forced and the answer runs under the schema's grammar;
- plain: no parser, the same schema from the first token;
- free: no parser, no schema, `--budget + 1` tokens (EOS ignored): the reasoning side's reasoning on its own.

The sides produce different token mixes (the plain side's answers are a third forced tokens, which count without
a step of their own; the reasoning side adds `--budget` sampled tokens to the same answers), so the ratio of their
tokens/s says little about what the switch costs. What isolates it: the reasoning side's time against the plain
and free sides' times added up (`vs_parts`: 1.0 means reasoning-then-answer costs what its two parts cost apart).

Both prompts open the reasoning block (`...<|im_start|>assistant\\n<think>\\n`, as DeepSeek-R1's and Qwen3's
thinking templates do), so the two sides prefill the same tokens and either parser starts in the reasoning
phase. Reported per side: output tokens/s (every output token: sampled, forced, the markers), sampled tokens/s,
how the outputs ended, and the share of outputs that validate against the schema, which must be 100% (the exit
status is 1 otherwise). The reasoning side's first `--budget` tokens of each output are unmasked, so where the
mask costs time its rate may exceed the plain side's; a ratio well below 1 is the switch's cost.

A model needs `<think>` and `</think>` as tokens of its vocabulary: SmolLM2 (the default elsewhere) and `tiny`
have none, so this benchmark runs on `tiny-thinking` or a reasoning checkpoint (Qwen3, DeepSeek-R1 distills).

    structgen bench reasoning [--model tiny-thinking|PATH] [--parser deepseek_r1|qwen3] [--batch 32]
        [--max-tokens 256] [--budget 64] [--passes 4] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from structgen.bench.structured_shape_schemas import SHAPES, validator

# Short, bounded strings and patterns (~60 tokens): every answer fits the room the budget leaves it.
SCHEMA = SHAPES["nested"]
ASK = "Describe a person with address and contact as JSON."
SEED = 2000
SIDES = ("reasoning", "plain", "free")
NO_MARKERS = (
    "{model}: {error}\nthis benchmark needs a reasoning model: SmolLM2 and tiny have no <think>/</think> "
    "tokens; use --model tiny-thinking or a Qwen3 / DeepSeek-R1 checkpoint"
)


@dataclass(slots=True)
class Tally:
    """One side's counts over its measured passes."""

    seconds: float = 0.0
    outputs: int = 0
    tokens: int = 0  # every output token: sampled, forced, markers
    sampled: int = 0
    reasoning_tokens: int = 0  # of `tokens`, spent before the answer (markers included)
    stop: int = 0
    length: int = 0
    errors: int = 0
    valid: int = 0
    invalid: int = 0  # finished but not valid (cut outputs count here too)
    reasoning_missing: int = 0  # the reasoning side only: an output without reasoning
    markers_leaked: int = 0  # a marker's text in the answer or the reasoning

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def report(self) -> dict[str, Any]:
        values = {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}
        sampled_rate = self.sampled / self.seconds if self.seconds else 0.0
        return {**values, "tok_s": round(self.rate(), 1), "sampled_tok_s": round(sampled_rate, 1)}


def make_engines(
    model: str, parser: str, *, batch: int, max_tokens: int, device: str | None
) -> tuple[Any, Any]:
    """(with the parser, without): the second engine shares the first one's loaded model."""
    from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
    from structgen.engine.llm_engine import LLMEngine

    def config(reasoning_parser: str | None) -> EngineConfig:
        return EngineConfig(
            model=model,
            device=device,
            cache=CacheConfig(kv_cache_tokens=max(8192, 2 * batch * (max_tokens + 64))),
            scheduler=SchedulerConfig(max_num_seqs=max(batch, 8), max_num_batched_tokens=4096),
            reasoning_parser=reasoning_parser,
        )

    thinking = LLMEngine(config(parser))
    plain = LLMEngine(
        config(None), model=thinking.model, tokenizer=thinking.tokenizer, model_dir=thinking.model_dir
    )
    return thinking, plain


def prompt(tokenizer: Any, tag: str, index: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"Request {tag}-{index}: {ASK}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not text.rstrip().endswith("<think>"):  # DeepSeek-R1's and the thinking-2507 templates open it already
        text += "<think>\n"
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def run_pass(
    engine: Any,
    tally: Tally | None,
    *,
    tag: str,
    batch: int,
    max_tokens: int,
    budget: int | None,
    free: bool = False,
) -> None:
    """`batch` requests to completion on `engine`, counted into `tally` (None: a warm-up). `free`: no schema,
    exactly `max_tokens` tokens each."""
    from structgen.sampling_params import SamplingParams
    from structgen.structured import StructuredOutputsParams

    so = None if free else StructuredOutputsParams(json=SCHEMA)
    for i in range(batch):
        params = SamplingParams(
            temperature=1.0,
            seed=SEED + i,
            max_tokens=max_tokens,
            structured_outputs=so,
            thinking_token_budget=budget,
            ignore_eos=free,
        )
        engine.add_request(f"{tag}-{i}", prompt(engine.tokenizer, tag, i), params, stream=False)
    sampled_before, seconds, finished = engine.counters.num_generated_tokens, 0.0, []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        seconds += time.perf_counter() - start
        finished += [out.outputs[0] for out in outputs if out.finished]
        if engine.last_step_num_tokens == 0:  # every request waits for its grammar: not stepping time
            engine.structured.wait(timeout=0.05)
    if tally is None:
        return
    tally.seconds += seconds
    tally.sampled += engine.counters.num_generated_tokens - sampled_before
    check = validator(SCHEMA)
    for output in finished:
        if free:
            tally.outputs += 1
            tally.tokens += len(output.token_ids)
        else:
            count(tally, output, check, reasoning=budget is not None)


def count(tally: Tally, output: Any, check: Any, *, reasoning: bool) -> None:
    tally.outputs += 1
    tally.tokens += len(output.token_ids)
    tally.reasoning_tokens += output.num_reasoning_tokens
    reason = output.finish_reason
    tally.stop += reason == "stop"
    tally.length += reason == "length"
    tally.errors += reason not in ("stop", "length")
    texts = [output.text, output.reasoning or ""]
    tally.markers_leaked += any("<think>" in t or "</think>" in t for t in texts)
    tally.reasoning_missing += reasoning and not output.reasoning
    try:
        ok = reason == "stop" and check.is_valid(json.loads(output.text))
    except ValueError:
        ok = False
    tally.valid += ok
    tally.invalid += not ok


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides' tallies over `args.passes` passes each; ReasoningParserError for a model without markers."""
    from structgen.structured import StructuredOutputsParams

    engines = make_engines(
        args.model, args.parser, batch=args.batch, max_tokens=args.max_tokens, device=args.device
    )
    budgets = {"reasoning": args.budget, "plain": None, "free": None}
    # The free side runs on the plain engine: the reasoning side's reasoning, alone.
    engines = (*engines, engines[1])
    options_of = {
        "reasoning": {"max_tokens": args.max_tokens},
        "plain": {"max_tokens": args.max_tokens},
        "free": {"max_tokens": args.budget + 1, "free": True},
    }
    tallies = {side: Tally() for side in SIDES}
    per_pass: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        spec = StructuredOutputsParams(json=SCHEMA).to_spec()
        for engine in engines[:2]:
            engine.structured.ensure_manager().compile(spec)
        for side, engine in zip(SIDES, engines, strict=True):  # warm-up: compile paths, allocator, caches
            batch = min(args.batch, 2)
            run_pass(engine, None, tag=f"w{side}", batch=batch, budget=budgets[side], **options_of[side])
        seconds: dict[str, list[float]] = {side: [] for side in SIDES}
        for k in range(args.passes):
            order = SIDES if k % 2 == 0 else SIDES[::-1]  # ABBA
            for side in order:
                tally, before = tallies[side], (tallies[side].tokens, tallies[side].seconds)
                engine = engines[SIDES.index(side)]
                # (The free side runs on the plain engine: its own tag keeps it from reading the plain side's
                # prompts from the prefix cache, so it prefills as the reasoning side does.)
                tag = f"f{k}" if side == "free" else f"p{k}"
                run_pass(engine, tally, tag=tag, batch=args.batch, budget=budgets[side], **options_of[side])
                seconds[side].append(tally.seconds - before[1])
                per_pass[side].append((tally.tokens - before[0]) / seconds[side][-1])
    finally:
        for engine in engines[:2]:
            engine.shutdown()
    thinking, plain, free = tallies["reasoning"], tallies["plain"], tallies["free"]
    outputs = thinking.outputs + plain.outputs
    return {
        "model": args.model,
        "parser": args.parser,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "budget": args.budget,
        "passes": args.passes,
        "reasoning_tok_s": round(thinking.rate(), 1),
        "plain_tok_s": round(plain.rate(), 1),
        "ratio": round(thinking.rate() / plain.rate(), 3),
        "ratio_per_pass": [
            round(a / b, 3) for a, b in zip(per_pass["reasoning"], per_pass["plain"], strict=True)
        ],
        # The reasoning side's time against its two parts' (see the module docstring); 1.0: the switch is free.
        "vs_parts": round((plain.seconds + free.seconds) / thinking.seconds, 3),
        "vs_parts_per_pass": [
            round((p + f) / r, 3)
            for r, p, f in zip(seconds["reasoning"], seconds["plain"], seconds["free"], strict=True)
        ],
        "valid_share": round((thinking.valid + plain.valid) / outputs, 4) if outputs else 0.0,
        "reasoning": thinking.report(),
        "plain": plain.report(),
        "free": free.report(),
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'side':10} {'tok/s':>8} {'sampled/s':>9} {'tokens':>7} {'reasoning':>9} {'outputs':>7} {'stop':>5} "
        f"{'cut':>4} {'valid':>5} {'no_reason':>9} {'leaked':>6}"
    )
    for side in SIDES:
        t = result[side]
        print(
            f"{side:10} {t['tok_s']:8} {t['sampled_tok_s']:9} {t['tokens']:7} {t['reasoning_tokens']:9} "
            f"{t['outputs']:7} {t['stop']:5} {t['length']:4} {t['valid']:5} {t['reasoning_missing']:9} "
            f"{t['markers_leaked']:6}"
        )
    print(
        f"ratio reasoning/plain: {result['ratio']} (per pass: {result['ratio_per_pass']}); "
        f"valid: {result['valid_share']:.1%}"
    )
    print(
        f"reasoning side vs its parts (plain + free time / reasoning time): {result['vs_parts']} "
        f"(per pass: {result['vs_parts_per_pass']})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-thinking", help="a reasoning model: registry name or path")
    ap.add_argument("--parser", default="deepseek_r1", choices=("deepseek_r1", "qwen3"))
    ap.add_argument(
        "--batch", type=int, default=32, help="concurrent requests per pass (default %(default)s)"
    )
    ap.add_argument("--max-tokens", type=int, default=256, help="per request (default %(default)s)")
    ap.add_argument(
        "--budget",
        type=int,
        default=64,
        help="thinking_token_budget of the reasoning side (default %(default)s)",
    )
    ap.add_argument("--passes", type=int, default=4, help="measured passes per side (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.passes < 1 or not 1 <= args.budget < args.max_tokens:
        ap.error("--batch and --passes must be >= 1 and --budget within 1..max-tokens - 1")

    import torch

    from structgen.tokenizer.reasoning import ReasoningParserError

    torch.set_num_threads(args.threads)
    try:
        result = measure(args)
    except ReasoningParserError as error:
        print(NO_MARKERS.format(model=args.model, error=error), file=sys.stderr)
        return 2
    print_table(result)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["reasoning"]["invalid"] + result["plain"]["invalid"] == 0 else 1
