"""`AsyncEngine`: the server's view of the engine. A background thread drives `LLMEngine.step()`; each request
gets an async iterator of `RequestOutput`s whose `delta_text` / `delta_token_ids` carry what is new.

The engine is not thread-safe, so only the step thread touches it: `generate` and `abort` post commands that the
thread applies between steps, and outputs travel back to the event loop with `call_soon_threadsafe`. Leaving the
iterator early (client disconnect, task cancelled, `break`) aborts the request and returns its blocks.

`from_config` builds the engine on the step thread itself, which matters on the CPU: torch's OpenMP runtime keeps
one team of worker threads per thread that has run a parallel op, and once the process holds more of them than
it has cores, every worker stops spinning between ops and sleeps instead (libgomp's throttled wait). A model
loaded on the main thread and stepped on another holds two teams, and SmolLM2's batch-32 decode step then takes
about twice as long (60,000 context switches where one team makes 300).

LoRA adapters (`structgen.lora`) are registered on the step thread too (`add_lora`, `remove_lora`); their files are
read on a worker thread first, so a big adapter never stalls the steps. `list_loras` / `get_lora` answer from a
snapshot the step thread replaces after each change, so the event loop can route a request by `model` without a
round trip through the step thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from structgen.engine.inputs import PromptInput
from structgen.engine.llm_engine import LLMEngine
from structgen.engine.metrics import EngineStats
from structgen.engine.output_streams import OutputStream, call_on_loop, deliver
from structgen.engine.outputs import RequestOutput
from structgen.lora import LoRAError, LoRARequest
from structgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from structgen.lora.manager import LoRAManager, ServedLoRA

logger = logging.getLogger(__name__)

# When every unfinished request waits on something outside the engine (a grammar compiling), the loop polls
# their `ready()` this often instead of spinning.
_IDLE_POLL_S = 0.002
_STATS_TIMEOUT_S = 5.0
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop crashed; the original exception is the `__cause__`."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine | None = None, *, build: Callable[[], LLMEngine] | None = None
    ) -> None:
        """Drive `engine`, or the engine `build()` returns, built on the step thread (raising what it raises)."""
        if (engine is None) == (build is None):
            raise ValueError("AsyncEngine takes an engine or a build function, not both or neither")
        if engine is not None and engine.device.type == "cpu" and torch.get_num_threads() > 1:
            logger.warning(  # see the module's note: every step then waits on sleeping OpenMP workers
                "AsyncEngine(engine): an engine built on another thread than the step thread decodes slower on the "
                "CPU (two OpenMP teams); build it there with AsyncEngine.from_config(config) or AsyncEngine(build=...)"
            )
        self.engine: LLMEngine = engine  # type: ignore[assignment]  # set by the step thread when built there
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self._streams: dict[str, OutputStream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._dead: BaseException | None = None
        # Callers waiting on a command that has not run yet (`generate`'s add, `on_step_thread`): failed at once if
        # the step loop dies first.
        self._adding: dict[asyncio.Future[Any], asyncio.AbstractEventLoop] = {}
        self._loras: dict[str, ServedLoRA] = {}  # replaced whole by the step thread, read anywhere
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(build,), name="structgen-engine", daemon=True)
        self._thread.start()
        if build is not None:
            self._built.wait()
            if self._build_error is not None:
                self._thread.join()
                raise self._build_error
        self._refresh_loras()  # adapters registered before the engine came here (nothing steps it yet)

    @classmethod
    def from_config(cls, config: Any = None, *, lora_modules: Sequence[LoRARequest] = ()) -> AsyncEngine:
        """An `LLMEngine(config)` built and stepped on the same thread (see the module's note), serving the
        `lora_modules` adapters from the start (`LoRAError` naming the adapter when one cannot be served)."""

        def build() -> LLMEngine:
            engine = LLMEngine(config)
            try:
                if lora_modules:
                    if engine.lora is None:
                        raise LoRAError(
                            "LoRA adapters were given, but the engine config has no LoRA (EngineConfig.lora)"
                        )
                    engine.lora.add_all(lora_modules)
            except BaseException:
                engine.shutdown()
                raise
            return engine

        return cls(build=build)

    # -- public API ------------------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        ready: Callable[[], bool] | None = None,
        stream: bool = True,
        reasoning: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs, one per step that produced tokens; the last has `finished=True`.
        `stream=False`: only the first output and the finished one (the first says the request runs; skipping
        the others spares the event loop a wake-up per step, whose thread would take a core from the forward's).

        `lora_request`: run with that adapter (`LLMEngine.add_request`; one without a path must be registered).

        Raises what `LLMEngine.add_request` raises (ValueError for a request that can never run, `LoRAError` for an
        adapter it cannot serve) on the first iteration. Closing the iterator before the end aborts the request.
        """
        self._check_alive()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        queue = OutputStream(loop, every_step=stream)
        added: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            with self._wakeup:
                self._adding.pop(added, None)
            try:
                if request_id in self._streams:
                    raise ValueError(f"request id {request_id!r} is already in use")
                self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    stream=True,
                    ready=ready,
                    reasoning=reasoning,
                    lora_request=lora_request,
                )
            except BaseException as error:  # reported to the caller, not to the step loop
                call_on_loop(loop, _resolve, added, error)
                return
            finally:
                if lora_request is not None and lora_request.lora_path:
                    self._refresh_loras()  # a request with a path registers its adapter on first use
            self._streams[request_id] = queue
            if not call_on_loop(loop, _resolve, added, None):
                self._abort(request_id)  # its caller's loop is gone: nobody will read it

        with self._wakeup:
            self._adding[added] = loop
        if not self._post(add):
            with self._wakeup:
                self._adding.pop(added, None)
            self._check_alive()
            raise EngineDeadError("the engine's step loop is not running")
        try:
            await added
        except asyncio.CancelledError:
            self._post(lambda: self._abort(request_id, queue))
            raise
        finished = False
        try:
            while True:
                item = await queue.queue.get()
                if item is None:  # aborted
                    return
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine's step loop failed") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._post(lambda: self._abort(request_id, queue))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends without a final output."""
        self._post(lambda: self._abort(request_id))

    async def stats(self) -> EngineStats:
        """`LLMEngine.stats()` taken on the step thread between steps (the scheduler's queues are not
        thread-safe); read directly when no step thread runs."""
        loop = asyncio.get_running_loop()
        taken: asyncio.Future[EngineStats] = loop.create_future()

        def take() -> None:
            stats = self.engine.stats()
            call_on_loop(loop, lambda: taken.done() or taken.set_result(stats))

        if self._post(take):
            try:
                return await asyncio.wait_for(taken, _STATS_TIMEOUT_S)
            except TimeoutError:  # the thread is stopping: nothing else touches the engine much longer
                pass
        return self.engine.stats()

    # -- LoRA adapters ---------------------------------------------------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora is not None

    def list_loras(self) -> list[ServedLoRA]:
        """The registered adapters, in the order they were registered."""
        return list(self._loras.values())

    def get_lora(self, name: str) -> ServedLoRA | None:
        return self._loras.get(name)

    async def add_lora(self, request: LoRARequest) -> ServedLoRA:
        """Serve the adapter at `request.lora_path` under its name. `LoRAError` when LoRA is off, the adapter
        cannot be served, or the name belongs to another adapter; the same name and path again is a no-op."""
        manager = self._lora_manager()
        if request.lora_name in self._loras:
            # `add` answers a known name from the registry (that adapter, or the error for another path)
            # without reading any file on the step thread.
            return await self.on_step_thread(lambda: manager.add(request), refresh_loras=True)
        # Reading touches no engine state: a worker thread does it while the steps go on.
        adapter = await asyncio.to_thread(manager.read, request)
        return await self.on_step_thread(lambda: manager.register(request, adapter), refresh_loras=True)

    async def remove_lora(self, name: str) -> ServedLoRA:
        """Unregister adapter `name`: new requests cannot name it, running ones finish with it. `LoRAError`
        (404) for a name no adapter has."""
        manager = self._lora_manager()
        return await self.on_step_thread(lambda: manager.remove(name), refresh_loras=True)

    def _lora_manager(self) -> LoRAManager:
        manager = self.engine.lora
        if manager is None:
            raise LoRAError(
                "LoRA adapters are not enabled: start the server with --enable-lora (EngineConfig.lora)"
            )
        return manager

    def _refresh_loras(self) -> None:
        manager = self.engine.lora
        if manager is not None:
            self._loras = {served.name: served for served in manager.registered()}

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort everything and stop the step thread (idempotent)."""
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.engine.shutdown()  # tensor-parallel workers, grammar threads: stop them now, not at exit

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # -- the step thread -------------------------------------------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> bool:
        """Queue a command for the step thread; False when no thread will ever run it."""
        with self._wakeup:
            if self._dead is not None or not self._thread.is_alive():
                return False
            self._commands.append(command)
            self._wakeup.notify()
            return True

    async def on_step_thread(self, fn: Callable[[], T], *, refresh_loras: bool = False) -> T:
        """`fn()` run by the step thread between steps: its result, or what it raised."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            with self._wakeup:
                self._adding.pop(done, None)
            try:
                result = fn()
            except BaseException as error:
                call_on_loop(loop, _resolve, done, error)
                return
            finally:
                if refresh_loras:
                    self._refresh_loras()
            call_on_loop(loop, _resolve, done, None, result)

        with self._wakeup:
            self._adding[done] = loop
        if not self._post(run):
            with self._wakeup:
                self._adding.pop(done, None)
            self._check_alive()
            raise EngineDeadError("the engine's step loop is not running")
        return await done

    def _abort(self, request_id: str, stream: OutputStream | None = None) -> None:
        """Abort `request_id` (only if it still belongs to `stream`, when given) and end its iterator."""
        current = self._streams.get(request_id)
        if current is None or (stream is not None and current is not stream):
            return
        self.engine.abort(request_id)
        del self._streams[request_id]
        current.put(None)

    def _run(self, build: Callable[[], LLMEngine] | None) -> None:
        if build is not None:
            try:
                self.engine = build()
            except BaseException as error:  # re-raised by the constructor, on the caller's thread
                self._build_error = error
                self._dead = error
                return
            finally:
                self._built.set()
        engine = self.engine
        try:
            while True:
                with self._wakeup:
                    while not self._stopped and not self._commands and not engine.has_unfinished():
                        self._wakeup.wait()
                    if self._stopped:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    command()
                if not engine.has_unfinished():
                    continue
                # A step's outputs go to the event loop in one call: each `call_soon_threadsafe` writes to the
                # loop's wake-up socket, and that write hands the GIL to the loop's thread, which runs before
                # this thread gets it back (32 hand-offs a step for 32 streamed requests).
                ready: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
                for output in engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    if output.finished:
                        del self._streams[output.request_id]
                    if stream.wants(output):
                        ready.setdefault(stream.loop, []).append((stream, output))
                for loop, items in ready.items():
                    if not call_on_loop(loop, deliver, items):  # a closed loop: its requests stop here
                        for stream, output in items:
                            self._abort(output.request_id, stream)
                if engine.last_step_num_tokens == 0:  # everyone waits on a grammar: poll, don't spin
                    with self._wakeup:
                        if not self._commands and not self._stopped:
                            self._wakeup.wait(_IDLE_POLL_S)
        except BaseException as error:
            logger.exception("engine step loop failed")
            with self._wakeup:
                self._dead = error
                adding, self._adding = self._adding, {}
                self._commands.clear()  # nothing will run them; their callers are failed here
            for stream in self._streams.values():
                stream.put(error)
            self._streams.clear()
            for future, loop in adding.items():
                dead = EngineDeadError("the engine's step loop failed")
                dead.__cause__ = error
                call_on_loop(loop, _resolve, future, dead)
            return
        # Shut down: requests added at the last moment are registered, then everything is aborted.
        with self._wakeup:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            command()
        for request_id in list(self._streams):
            self._abort(request_id)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine's step loop failed") from self._dead
        if self._stopped:
            raise EngineDeadError("the engine was shut down")


def _resolve(future: asyncio.Future[Any], error: BaseException | None, result: Any = None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
