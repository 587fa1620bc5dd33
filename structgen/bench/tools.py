"""Tool-calling benchmark on the Berkeley Function Calling Leaderboard (BFCL v4) questions.

    python benchmarks/tools.py [--model smollm2-135m] [--per-category K] [--max-tokens N] [--threads N]
                                [--json OUT] [--outputs OUT.jsonl]

Every question of the four BFCL files (simple_python, multiple, parallel, parallel_multiple; 1,000 in all)
is asked with its own functions (the standard-JSON-Schema versions in `normalized_tools.jsonl`) and
`tool_choice="required"` (`parallel_tool_calls` only for the parallel categories: the others take exactly
one call), batched through the offline engine, greedy. An output is a *valid call* when it is
one or more calls, each naming one of the question's functions with arguments that validate (`jsonschema`)
against that function's parameters. Reported: the valid rate among finished outputs (target 100%), the
truncation rate (outputs that hit `--max-tokens`), and throughput. The baseline, in the same run, is the same
prompts generated without the grammar (the model sees the same tool list and format instructions): its valid
rate and throughput, and the ratios. `--per-category K` runs a stratified sample (every n-th question of each
file, K per file) and projects the full run's time.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
DEFAULT_BFCL = Path(__file__).resolve().parents[3] / "shared" / "data" / "bfcl"


@dataclass(frozen=True, slots=True)
class Question:
    id: str
    category: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]  # OpenAI tool definitions

    @property
    def parallel(self) -> bool:
        """BFCL's simple and multiple questions take exactly one call; the parallel ones several."""
        return self.category.startswith("parallel")


def load_questions(bfcl_dir: Path, *, per_category: int | None = None) -> list[Question]:
    """BFCL questions with their normalized functions; `per_category` picks K evenly spread per file."""
    functions: dict[str, list[dict[str, Any]]] = {}
    with open(bfcl_dir / "normalized_tools.jsonl", encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            function = {
                "name": row["name"],
                "description": row["description"],
                "parameters": row["parameters"],
            }
            functions.setdefault(row["id"].split("#")[0], []).append(
                {"type": "function", "function": function}
            )
    questions = []
    for category in CATEGORIES:
        with open(bfcl_dir / f"BFCL_v4_{category}.json", encoding="utf-8") as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
        if per_category is not None and per_category < len(rows):
            step = len(rows) / per_category
            rows = [rows[int(i * step)] for i in range(per_category)]
        for row in rows:
            questions.append(Question(row["id"], category, row["question"][0], functions[row["id"]]))
    return questions


@dataclass(slots=True)
class Score:
    total: int = 0
    finished: int = 0
    valid: int = 0
    truncated: int = 0
    rejected: int = 0  # requests refused up front (a schema the grammar cannot take)
    valid_any: int = 0  # outputs holding a complete block of valid calls, truncated after it or not
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, parsed: Any, output: Any) -> None:
        self.total += 1
        self.tokens += len(output.token_ids)
        self.valid_any += bool(parsed.calls) and parsed.valid
        if output.finish_reason == "length":
            self.truncated += 1
            return
        self.finished += 1
        self.calls += len(parsed.calls)
        self.valid += bool(parsed.calls) and parsed.valid

    def row(self) -> dict[str, Any]:
        return {
            "questions": self.total,
            "finished": self.finished,
            "valid": self.valid,
            "valid_rate": self.valid / self.finished if self.finished else None,
            "truncated_rate": self.truncated / self.total if self.total else None,
            "valid_of_all_rate": self.valid_any / self.total if self.total else None,
            "rejected": self.rejected,
            "calls_per_output": self.calls / self.finished if self.finished else None,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else None,
        }


@dataclass(frozen=True, slots=True)
class Request:
    question: Question
    plan: Any  # ToolCallPlan
    prompt: dict[str, Any]
    params: Any  # SamplingParams


def build_requests(
    questions: Sequence[Question], tokenizer: Any, params: Any, *, constrained: bool
) -> tuple[list[Request], int]:
    """The engine requests for the questions a plan could be built for, and how many were refused."""
    from structgen.tools import ToolCallPlan, ToolError

    requests, refused = [], 0
    for question in questions:
        try:
            plan = ToolCallPlan.build(
                question.tools,
                "required",
                parallel_tool_calls=question.parallel,
                chat_template=tokenizer.chat_template,
            )
            request_params = plan.sampling_params(params) if constrained else params
        except ToolError:
            refused += 1
            continue
        messages, template_tools = plan.conversation(question.messages)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=template_tools)
        prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        requests.append(Request(question, plan, prompt, request_params))
    return requests, refused


def run(
    llm: Any,
    questions: Sequence[Question],
    *,
    max_tokens: int,
    constrained: bool,
    batch: int,
    report: list[dict[str, Any]] | None = None,
) -> dict[str, Score]:
    """Generate for `questions` (all in the same batches) and score the outputs per category and overall
    ("all"); `report` collects one record per output."""
    from structgen.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    requests, refused = build_requests(questions, llm.get_tokenizer(), params, constrained=constrained)
    scores = {name: Score() for name in (*CATEGORIES, "all")}
    scores["all"].rejected = scores["all"].total = refused
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i : i + batch]
        results = llm.generate([r.prompt for r in chunk], [r.params for r in chunk])
        for request, result in zip(chunk, results, strict=True):
            output = result.outputs[0]
            parsed = request.plan.parse(output.text)
            for score in (scores[request.question.category], scores["all"]):
                if output.finish_reason == "error":
                    score.rejected += 1
                    score.total += 1
                else:
                    score.add(parsed, output)
            if report is not None:
                report.append(
                    {
                        "id": request.question.id,
                        "grammar": constrained,
                        "finish_reason": output.finish_reason,
                        "valid": bool(parsed.calls) and parsed.valid,
                        "text": output.text,
                    }
                )
    scores["all"].seconds = time.perf_counter() - start
    return scores


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/tools.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bfcl", type=Path, default=DEFAULT_BFCL, help="the BFCL data folder")
    parser.add_argument(
        "--per-category", type=int, default=None, help="stratified sample: K questions per file"
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=64, help="questions per engine batch")
    parser.add_argument("--kv-cache-tokens", type=int, default=16 * 1024)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (1 on a busy shared machine)"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the unconstrained baseline")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    parser.add_argument("--outputs", type=Path, default=None, help="write every output here (JSON lines)")
    args = parser.parse_args(argv)
    if not (args.bfcl / "normalized_tools.jsonl").is_file():
        print(f"error: no BFCL data in {args.bfcl} (pass --bfcl DIR)", file=sys.stderr)
        return 2

    import torch

    from structgen.engine.llm import LLM
    from structgen.structured import StructuredOutputConfig

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    questions = load_questions(args.bfcl, per_category=args.per_category)
    # Compiles run at normal priority: this measures outputs, and on a busy machine a niced compile thread
    # can starve behind the step loop until it hits the compile timeout.
    structured = StructuredOutputConfig(compile_nice=0)
    llm = LLM(
        args.model, kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.batch, structured=structured
    )
    results: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "per_category": {},
    }
    report: list[dict[str, Any]] = []
    scores = run(
        llm, questions, max_tokens=args.max_tokens, constrained=True, batch=args.batch, report=report
    )
    results["per_category"] = {c: scores[c].row() for c in CATEGORIES}
    total = scores["all"]
    results["grammar"] = total.row()
    if not args.no_baseline:
        baseline = run(
            llm, questions, max_tokens=args.max_tokens, constrained=False, batch=args.batch, report=report
        )
        results["baseline"] = baseline["all"].row()
    full = sum(1 for _ in load_questions(args.bfcl))
    results["projected_full_seconds"] = round(total.seconds * full / max(len(questions), 1), 1)
    results["machine"] = f"{platform.machine()} {platform.processor() or ''}".strip()
    _print(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.outputs is not None:
        args.outputs.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in report))
    return 0


def _print(results: dict[str, Any]) -> None:
    def fmt(column: str, value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.1%}" if column.endswith("_rate") else str(round(value, 2))

    columns = (
        "questions",
        "finished",
        "valid",
        "valid_rate",
        "truncated_rate",
        "valid_of_all_rate",
        "calls_per_output",
        "tokens_per_s",
    )
    rows = [(c, r) for c, r in results["per_category"].items()] + [("grammar (all)", results["grammar"])]
    if "baseline" in results:
        rows.append(("no grammar (baseline)", results["baseline"]))
    print(f"{'':24}" + "".join(f"{c:>19}" for c in columns))
    for name, row in rows:
        print(f"{name:24}" + "".join(f"{fmt(c, row[c]):>19}" for c in columns))
    if "baseline" in results:
        grammar, baseline = results["grammar"], results["baseline"]
        if baseline["valid_of_all_rate"]:
            ratio = grammar["valid_of_all_rate"] / baseline["valid_of_all_rate"]
            print(f"valid calls among all outputs, grammar / baseline: {ratio:.2f}x")
        if baseline["tokens_per_s"]:
            print(
                f"throughput, grammar / baseline: {grammar['tokens_per_s'] / baseline['tokens_per_s']:.2f}x"
            )
    print(f"projected time for all questions (grammar): {results['projected_full_seconds']} s")


if __name__ == "__main__":
    sys.exit(main())
