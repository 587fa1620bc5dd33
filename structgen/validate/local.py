"""The in-process runner: one `LLMEngine`, many schemas in flight at once.

Each schema compiles on the engine's own structured-output manager (its cache then serves the request the
same compile), so the grammar's verdict on the labelled instances is checked on exactly the grammar that
constrains generation. Up to `concurrency` schemas are compiling or generating at any time; the engine
batches their requests.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from structgen.validate.checks import GenerationOptions, build_prompt, judge, schema_problem
from structgen.validate.corpus import SchemaCase
from structgen.validate.labels import check_labels
from structgen.validate.records import SampleRecord, SchemaRecord

if TYPE_CHECKING:
    from structgen.engine.llm_engine import LLMEngine
    from structgen.engine.outputs import RequestOutput
    from structgen.structured import CompiledSpec, StructuredOutputManager

Emit = Callable[[SchemaRecord, list[SampleRecord]], None]


@dataclass(slots=True)
class _Compiling:
    case: SchemaCase
    future: Future[CompiledSpec]


def build_backends(engine: LLMEngine) -> StructuredOutputManager:
    """The engine's manager with every backend its policy may use already built (seconds each, reading the
    vocabulary): the manager otherwise builds them inside the first compile, under its time limit."""
    from structgen.structured.select import AUTO_ORDER

    manager = engine.structured.ensure_manager()
    backend = manager.config.backend
    for name in AUTO_ORDER if backend == "auto" else (backend,):
        manager.backend(name)
    return manager


class LocalRunner:
    def __init__(self, engine: LLMEngine, options: GenerationOptions, *, concurrency: int) -> None:
        self.engine = engine
        self.options = options
        self.concurrency = concurrency
        self.manager = build_backends(engine)
        config = self.manager.config
        # The manager's time limit runs from submission: more compiles than its workers would queue and time
        # out without having run, so no more are submitted than it runs at once.
        self.max_compiling = min(concurrency, config.compile_workers)
        self._ids = itertools.count()

    @property
    def abandoned_compiles(self) -> int:
        """Compiles that outlived their time limit (their threads may still be running)."""
        return self.manager.stats.timeouts

    def run(self, cases: Sequence[SchemaCase], emit: Emit) -> None:
        """Generate under every schema; `emit` each schema's record with its samples once it is done."""
        pending = deque(cases)
        compiling: list[_Compiling] = []
        running: dict[str, tuple[SchemaCase, SchemaRecord]] = {}
        try:
            while pending or compiling or running:
                while (
                    pending
                    and len(compiling) + len(running) < self.concurrency
                    and len(compiling) < self.max_compiling
                ):
                    started = self._start(pending.popleft(), emit)
                    if started is not None:
                        compiling.append(started)
                still = []
                for job in compiling:
                    if not job.future.done():
                        still.append(job)
                        continue
                    record = self._compiled(job, emit)
                    if record is None:
                        continue
                    try:
                        running[self._submit(job.case)] = (job.case, record)
                    except ValueError as e:  # the prompt does not fit the context with max_tokens
                        emit(record, self._failed(job.case, str(e)))
                compiling = still
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.finished and out.request_id in running:
                            case, record = running.pop(out.request_id)
                            emit(record, self._samples(case, out))
                    if self.engine.last_step_num_tokens:
                        continue
                # Nothing to run until a compile finishes: wait for one instead of spinning on empty steps
                # (the compile threads need the GIL and the cores).
                futures = [job.future for job in compiling]
                if futures:
                    wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)
                elif running:
                    time.sleep(0.005)  # requests waiting on the engine's own grammar futures
        except BaseException:
            self.engine.abort(list(running))
            raise

    def _start(self, case: SchemaCase, emit: Emit) -> _Compiling | None:
        from structgen.structured import InvalidSpecError, StructuredOutputsParams

        problem = schema_problem(case.schema)
        if problem is None:
            try:
                spec = StructuredOutputsParams(json=case.schema).to_spec()
            except InvalidSpecError as e:
                problem = str(e)
        if problem is not None:
            emit(SchemaRecord(case.id, case.subset, "invalid_schema", error=problem), [])
            return None
        return _Compiling(case, self.manager.submit(spec))

    def _compiled(self, job: _Compiling, emit: Emit) -> SchemaRecord | None:
        """The schema's record once compiled (labels checked), or None after emitting why it did not compile."""
        from structgen.structured import CompileTimeoutError, UnsupportedSchemaError

        case = job.case
        error = job.future.exception()
        if error is not None:
            if isinstance(error, UnsupportedSchemaError):
                record = SchemaRecord(
                    case.id,
                    case.subset,
                    "unsupported",
                    keyword=error.keyword,
                    path=error.path,
                    error=str(error),
                )
            elif isinstance(error, CompileTimeoutError):
                record = SchemaRecord(case.id, case.subset, "timeout", error=str(error))
            else:
                record = SchemaRecord(case.id, case.subset, "error", error=str(error))
            emit(record, [])
            return None
        compiled = job.future.result()
        labels = None
        if case.tests:
            tokenizer = self.engine.tokenizer
            labels = check_labels(
                compiled,
                case.tests,
                encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                eos_token_id=self.manager.tokenizer.eos_token_ids[0],
            ).to_dict()
        return SchemaRecord(
            case.id,
            case.subset,
            "compiled",
            backend=compiled.backend,
            path=compiled.serving_path,
            compile_s=compiled.compile_time_s,
            labels=labels,
        )

    def _submit(self, case: SchemaCase) -> str:
        from structgen import SamplingParams
        from structgen.structured import StructuredOutputsParams

        tokenizer = self.engine.tokenizer
        messages = [{"role": "user", "content": build_prompt(self.options, case.schema)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        params = SamplingParams(
            n=self.options.samples,
            max_tokens=self.options.max_tokens,
            temperature=self.options.temperature,
            seed=self.options.seed,
            structured_outputs=StructuredOutputsParams(json=case.schema),
        )
        request_id = f"validate-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params, stream=False)  # type: ignore[arg-type]
        return request_id

    def _failed(self, case: SchemaCase, error: str) -> list[SampleRecord]:
        return [
            SampleRecord(case.id, case.subset, i, "error", None, "", 0, None, error)
            for i in range(self.options.samples)
        ]

    def _samples(self, case: SchemaCase, out: RequestOutput) -> list[SampleRecord]:
        latency = out.metrics.e2e_latency if out.metrics is not None else None
        records = []
        for o in out.outputs:
            status, error = judge(o.finish_reason, o.text, case.schema, o.error)
            records.append(
                SampleRecord(
                    case.id,
                    case.subset,
                    o.index,
                    status,
                    o.finish_reason,
                    o.text,
                    len(o.token_ids),
                    latency,
                    error,
                )
            )
        return records
