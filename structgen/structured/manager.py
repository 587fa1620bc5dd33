"""Compilation off the hot path and the per-step batch mask.

`submit(spec)` returns at once with a future (the engine parks the request in WAITING_FOR_GRAMMAR and
polls `done()`); compiles run on a thread pool (the libraries release the GIL), results land in an LRU
cache keyed by (backend choice, canonical spec, options, tokenizer id), concurrent requests for the same
spec share one compile, and a compile that outlives the time limit fails its future with a clear error.
Before compiling, `config.limits` (limits.py) refuses a spec whose cost could be unbounded. A timed-out compile
still queued is cancelled; one running in native code cannot be interrupted, so its thread is abandoned (it
finishes in the background, niced, and a late result is still cached) and later compiles go to a fresh pool;
past `max_abandoned_compiles` still running, new compiles are refused (`CompileBusyError`) until some end.
`fill_bitmask` fills the rows of a step's constrained requests, each backend's rows in one native batched call;
`on_mask_thread` runs it (and what reads those rows) on one worker thread while the model forward runs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from structgen.structured.backend import BACKEND_NAMES, Grammar, StructuredBackend, create_backend
from structgen.structured.bitmask import allocate_token_bitmask
from structgen.structured.closing import ByteTokens, initial_need
from structgen.structured.errors import CompileBusyError, CompileTimeoutError, StructuredOutputError
from structgen.structured.finishing import emits_json, pattern_hints
from structgen.structured.limits import SchemaLimits
from structgen.structured.loop_guard import DEFAULT_MAX_NUMBER_DIGITS
from structgen.structured.select import AUTO_ORDER, CompiledSpec, compile_spec
from structgen.structured.spec import StructuredSpec
from structgen.structured.tokenizer_info import TokenizerInfo
from structgen.structured.unroll import DEFAULT_RECURSION_DEPTH

CacheKey = tuple[str, tuple[str, str, str, str, int], str]
FillFailures = list[tuple[int, Exception]]  # (bitmask row, the error its grammar raised)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StructuredOutputConfig:
    """Engine-level settings of the structured-output layer (`--structured-backend` etc.)."""

    backend: str = "auto"  # auto | llguidance | xgrammar | outlines
    compile_timeout_s: float = 30.0
    compile_workers: int = 4
    cache_size: int = 512
    max_validation_retries: int = 3
    # Append the tokens a grammar forces without sampling them (prefilled with the next step).
    jump_forward: bool = True
    limits: SchemaLimits = field(default_factory=SchemaLimits)
    # A timed-out compile cannot be interrupted (native code): its thread is abandoned and new compiles go
    # to fresh workers. Past this many still running, new compiles are refused until some finish.
    max_abandoned_compiles: int = 4
    # Compile threads run at this nice level (Linux) so a long compile does not take CPU from the step loop.
    compile_nice: int = 10
    # Levels of each `$ref` cycle a recursive schema's grammar generates when no backend takes the cycle as
    # is (the "restricted" path, `unroll.py`); 0 refuses such schemas instead.
    recursion_depth: int = DEFAULT_RECURSION_DEPTH
    # Defaults of the per-request switches (`StructuredOutputsParams.close_at_budget` / `.loop_guard`) for JSON
    # Schema, json_object and tool-call outputs: finish the structure when the tokens left come down to what it
    # needs (`closing.py`); end a string or array the model loops in (`loop_guard.py`). Regex, grammar and
    # choice outputs get either only when the request asks.
    close_at_budget: bool = True
    loop_guard: bool = True
    # The loop guard also ends a JSON number whose text runs past this many characters (0: no bound).
    max_number_digits: int = DEFAULT_MAX_NUMBER_DIGITS

    def __post_init__(self) -> None:
        if self.backend != "auto" and self.backend not in BACKEND_NAMES:
            raise ValueError(
                f"structured backend must be auto or one of {', '.join(BACKEND_NAMES)}, got {self.backend!r}"
            )
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be positive, got {self.compile_timeout_s}")
        if self.compile_workers < 1 or self.cache_size < 1 or self.max_validation_retries < 0:
            raise ValueError("compile_workers and cache_size must be >= 1, max_validation_retries >= 0")
        if self.recursion_depth < 0:
            raise ValueError(f"recursion_depth must be >= 0, got {self.recursion_depth}")
        if self.max_number_digits < 0:
            raise ValueError(f"max_number_digits must be >= 0, got {self.max_number_digits}")
        if self.max_abandoned_compiles < 0 or not 0 <= self.compile_nice <= 19:
            raise ValueError("max_abandoned_compiles must be >= 0 and compile_nice in 0..19")


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    compiles: int = 0
    failures: int = 0
    timeouts: int = 0
    abandoned: int = 0  # compiles that ran past their time limit (their threads were left to finish)
    refused_by_limits: int = 0
    # Seconds of the latest successful compiles (`compiles` counts them all), for the server's histogram.
    recent_compile_times: deque[float] = field(default_factory=lambda: deque(maxlen=1024))


class StructuredOutputManager:
    """One per engine (tokenizer). `backends` may pass prebuilt backends for this tokenizer (they take
    seconds to build, reading the whole vocabulary); the others are built on first use."""

    def __init__(
        self,
        tokenizer: TokenizerInfo,
        config: StructuredOutputConfig | None = None,
        *,
        backends: Mapping[str, StructuredBackend] | None = None,
    ):
        self.tokenizer = tokenizer
        self.config = config or StructuredOutputConfig()
        self.stats = CacheStats()
        self._order = AUTO_ORDER if self.config.backend == "auto" else (self.config.backend,)
        self._backends: dict[str, StructuredBackend] = {}
        for name, backend in (backends or {}).items():
            if backend.tokenizer.tokenizer_id != tokenizer.tokenizer_id:
                raise ValueError(f"backend {name!r} was built for another tokenizer")
            self._backends[name] = backend
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[CacheKey, Future[CompiledSpec]] = OrderedDict()
        self._lock = threading.Lock()
        self._compile_pool = self._new_compile_pool()
        # Compiles past their time limit whose native call still runs (each holds one thread).
        self._abandoned: set[Future[CompiledSpec]] = set()
        # One thread suffices: each backend's batched fill runs on the library's own native threads.
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="structgen-mask")
        # The preferred backend is built now, so the first request's compile time is only its compile.
        self.backend(self._order[0])

    # -- compilation ---------------------------------------------------------------------------------

    def backend(self, name: str) -> StructuredBackend:
        """The backend instance for `name`, built on first use (building reads the whole vocabulary)."""
        with self._backend_lock:
            if name not in self._backends:
                self._backends[name] = create_backend(name, self.tokenizer)
            return self._backends[name]

    def cache_key(self, spec: StructuredSpec) -> CacheKey:
        return (self.config.backend, spec.key, self.tokenizer.tokenizer_id)

    def submit(self, spec: StructuredSpec) -> Future[CompiledSpec]:
        """A future of the compiled spec; done immediately on a cache hit. Never blocks on compiling."""
        key = self.cache_key(spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return cached
            self.stats.misses += 1
            outer: Future[CompiledSpec] = Future()
            if len(self._abandoned) > self.config.max_abandoned_compiles:
                self.stats.failures += 1
                outer.set_exception(CompileBusyError(len(self._abandoned)))
                return outer  # busy now, not later: not cached
            self._insert(key, outer)
        limit = self.config.compile_timeout_s
        inner = self._submit_compile(spec, limit)
        timer = threading.Timer(limit, self._expire, args=(key, outer, spec, inner))
        timer.daemon = True
        inner.add_done_callback(lambda f: self._finish(key, outer, f, timer))
        timer.start()
        return outer

    def _submit_compile(self, spec: StructuredSpec, limit: float) -> Future[CompiledSpec]:
        while True:
            pool = self._compile_pool
            try:
                return pool.submit(self._compile, spec, limit)
            except RuntimeError:
                if pool is self._compile_pool:  # not swapped for a fresh one: the manager shut down
                    raise

    def _new_compile_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            self.config.compile_workers,
            thread_name_prefix="structgen-compile",
            initializer=_lower_priority,
            initargs=(self.config.compile_nice,),
        )

    def compile(self, spec: StructuredSpec) -> CompiledSpec:
        """Blocking `submit(spec).result()`."""
        return self.submit(spec).result()

    def _compile(self, spec: StructuredSpec, limit: float) -> CompiledSpec:
        # The limits walk (milliseconds, linear in the spec) runs here, not on the caller's (step) thread.
        try:
            self.config.limits.check(spec)
        except StructuredOutputError:
            with self._lock:
                self.stats.refused_by_limits += 1
            raise
        backends = [self.backend(name) for name in self._order]
        compiled = compile_spec(
            spec, backends, time_limit_s=limit, recursion_depth=self.config.recursion_depth
        )
        if self.config.close_at_budget and emits_json(spec):
            # The shortest complete output, walked here once per grammar (up to ~0.2 s for a long minLength
            # string) and cached, so a request's start on the step thread finds it (`Finisher.prepare`).
            try:
                key = (compiled.backend, *compiled.spec.key)
                initial_need(
                    ByteTokens.of(self.tokenizer), key, compiled.new_grammar, hints=pattern_hints(spec)
                )
            except Exception:  # the request walks it itself and meets the error there
                pass
        return compiled

    def _finish(
        self, key: CacheKey, outer: Future[CompiledSpec], inner: Future[CompiledSpec], timer: threading.Timer
    ) -> None:
        timer.cancel()
        if inner.cancelled():
            return  # timed out while queued; `_expire` fails the request
        error = inner.exception()
        with self._lock:
            self._abandoned.discard(inner)
            if error is None:
                self.stats.compiles += 1
                self.stats.recent_compile_times.append(inner.result().compile_time_s)
            if outer.done():
                # The timer failed the request already; a late success still serves the next request.
                if error is None and key not in self._cache:
                    late: Future[CompiledSpec] = Future()
                    late.set_result(inner.result())
                    self._insert(key, late)
                return
            if error is not None:
                self.stats.failures += 1
            if isinstance(error, CompileTimeoutError):
                self.stats.timeouts += 1
                self._cache.pop(key, None)  # may succeed another time: do not cache the failure
        if error is None:
            _resolve(outer, result=inner.result())
        elif isinstance(error, StructuredOutputError):
            _resolve(outer, error=error)
        else:
            _resolve(outer, error=StructuredOutputError(f"compiling the grammar failed: {error!r}"))

    def _expire(
        self, key: CacheKey, outer: Future[CompiledSpec], spec: StructuredSpec, inner: Future[CompiledSpec]
    ) -> None:
        with self._lock:
            if outer.done():
                return
            self.stats.failures += 1
            self.stats.timeouts += 1
            if self._cache.get(key) is outer:
                del self._cache[key]
        # Still queued behind other compiles: it never starts. (Outside the lock: `_finish` runs in cancel.)
        if not inner.cancel():
            with self._lock:
                if not inner.done():
                    # Running in native code, which cannot be interrupted: leave its thread to finish (a late
                    # result is still cached) and send later compiles to a fresh pool, so that stuck threads
                    # never fill it. `_finish` forgets it when it ends.
                    self.stats.abandoned += 1
                    self._abandoned.add(inner)
                    self._compile_pool.shutdown(wait=False)
                    self._compile_pool = self._new_compile_pool()
        _resolve(outer, error=CompileTimeoutError(self.config.compile_timeout_s, spec.describe()))

    def _insert(self, key: CacheKey, future: Future[CompiledSpec]) -> None:
        self._cache[key] = future
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    @property
    def num_abandoned(self) -> int:
        """Compiles past their time limit whose threads are still running."""
        with self._lock:
            return len(self._abandoned)

    # -- per-step masks ------------------------------------------------------------------------------

    def allocate_bitmask(self, max_batch_size: int, *, pin_memory: bool = False) -> torch.Tensor:
        return allocate_token_bitmask(max_batch_size, self.tokenizer.vocab_size, pin_memory=pin_memory)

    def fill_bitmask(self, items: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> FillFailures:
        """Fill `bitmask[row]` for each (grammar, row); rows not listed are left as they are. Returns the rows
        whose grammar raised, with the error (their contents are undefined): one broken grammar fails its own
        request, not the batch."""
        if not items:
            return []
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        groups: dict[int, tuple[StructuredBackend, list[tuple[Grammar, int]]]] = {}
        for grammar, row in items:
            backend = grammar.backend
            groups.setdefault(id(backend), (backend, []))[1].append((grammar, row))
        failures: FillFailures = []
        for backend, group in groups.values():
            try:
                backend.fill_bitmask_batch(group, bitmask)
            except Exception:
                # The batched call does not say whose grammar failed: fill the group row by row to find out.
                for grammar, row in group:
                    try:
                        grammar.fill_bitmask(bitmask, row)
                    except Exception as error:
                        failures.append((row, error))
        return failures

    def on_mask_thread(self, job: Callable[..., T], *args: Any) -> Future[T]:
        """`job(*args)` on the mask thread, after the fills queued before it (a fill and what reads its rows)."""
        return self._fill_pool.submit(job, *args)

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority(nice: int) -> None:
    # On Linux a thread is a task with its own nice value; elsewhere this is a no-op.
    if nice and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def _resolve(
    future: Future[CompiledSpec], *, result: CompiledSpec | None = None, error: BaseException | None = None
) -> None:
    """Settle a future unless the timer or the compile settled it first (the first outcome stands)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass
