"""`LoRAManager`: the engine's adapters: registered by name, swapped into the model's slots as steps need them.

Registered adapters keep a CPU copy (`LoRAAdapter`); `max_loras` of them sit in the model's slots. Before each
step `prepare` puts every adapter the step's rows use into a slot (taking a free one, else the slot of an
unloaded adapter, else the least recently used one no row of this step needs) and sets the step's token-to-slot
mask. The scheduler never runs more distinct adapters at once than there are slots (`Scheduler.max_loras`), so a
step always fits. Each load of an adapter gets its own prefix-cache key: blocks computed with one adapter are
never served to another, nor to the base model, nor to a later adapter loaded under the same name.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from structgen.lora.adapter import LoRAAdapter, LoRAError, TargetShapes, load_adapter
from structgen.lora.layers import LoRALinear, LoRAStep, attach_lora_layers
from structgen.lora.request import LoRARequest

if TYPE_CHECKING:
    from torch import nn

    from structgen.config import LoRAConfig
    from structgen.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class ServedLoRA:
    """A registered adapter; sequences that run with it hold this handle (`Sequence.lora`)."""

    request: LoRARequest
    adapter: LoRAAdapter
    cache_key: bytes  # mixed into the prefix cache's root hash of its sequences
    slot: int | None = None
    removed: bool = False  # unloaded: new requests cannot name it; running ones finish with it

    @property
    def name(self) -> str:
        return self.request.lora_name


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        weight = next(model.parameters())
        self.config = config
        self.dtype, self.device = weight.dtype, weight.device
        self.shapes = TargetShapes.from_config(model.config)  # type: ignore[attr-defined]
        self.step = LoRAStep()
        self.layers: dict[tuple[int, str], LoRALinear] = attach_lora_layers(
            model, self.step, self.shapes, num_slots=config.max_loras, max_rank=config.max_lora_rank
        )
        self._served: dict[str, ServedLoRA] = {}
        self._slots: list[ServedLoRA | None] = [None] * config.max_loras
        self._last_used = [0] * config.max_loras
        self._clock = 0
        self._keys = itertools.count()
        self.num_slot_loads = 0
        self.num_evictions = 0

    # -- registry ----------------------------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> ServedLoRA:
        """Load and register the adapter at `request.lora_path` under its name; LoRAError when it cannot be
        served or the name is taken by another adapter (the same name and path again is a no-op)."""
        existing = self._check_new(request)
        return existing if existing is not None else self.register(request, self.read(request))

    def add_all(self, requests: Iterable[LoRARequest]) -> None:
        """`add` each adapter (those a server starts with), each error naming its adapter."""
        for request in requests:
            try:
                self.add(request)
            except LoRAError as error:
                raise LoRAError(
                    f"LoRA adapter {request.lora_name!r}: {error}", status=error.status, code=error.code
                ) from None

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter's files (LoRAError naming what is wrong). Touches no engine state, so a
        server runs it off the step thread and hands the result to `register` there."""
        if not request.lora_path:
            raise LoRAError(f"no LoRA adapter named {request.lora_name!r} is loaded", status=404)
        return load_adapter(
            request.lora_name,
            request.lora_path,
            self.shapes,
            max_rank=self.config.max_lora_rank,
            dtype=self.dtype,
        )

    def register(self, request: LoRARequest, adapter: LoRAAdapter) -> ServedLoRA:
        """Serve `adapter` (from `read`) under the request's name."""
        existing = self._check_new(request)
        if existing is not None:
            return existing
        limit = self.config.max_cpu_loras
        if limit is not None and len(self._served) >= limit:
            raise LoRAError(
                f"{limit} LoRA adapters are loaded already (max_cpu_loras); unload one first",
                code="too_many_loras",
            )
        served = ServedLoRA(
            request=request,
            adapter=adapter,
            cache_key=f"lora:{next(self._keys)}:{request.lora_name}:{adapter.path}".encode(),
        )
        self._served[request.lora_name] = served
        logger.info(
            "LoRA adapter %r loaded from %s: rank <= %d on %s",
            request.lora_name,
            adapter.path,
            adapter.max_rank,
            ", ".join(adapter.target_modules),
        )
        return served

    def _check_new(self, request: LoRARequest) -> ServedLoRA | None:
        """The registered adapter when the same name and path come again; LoRAError when the name is taken."""
        existing = self._served.get(request.lora_name)
        if existing is None:
            return None
        if request.lora_path and _same_path(request.lora_path, existing.adapter.path):
            return existing
        raise LoRAError(
            f"a LoRA adapter named {request.lora_name!r} is already loaded (from {existing.adapter.path}); "
            "unload it first or choose another name",
            code="lora_name_taken",
        )

    def resolve(self, request: LoRARequest) -> ServedLoRA:
        """The registered adapter a request names, loading it from its path on first use."""
        served = self._served.get(request.lora_name)
        return served if served is not None else self.add(request)

    def get(self, name: str) -> ServedLoRA | None:
        return self._served.get(name)

    def remove(self, name: str) -> ServedLoRA:
        """Unregister an adapter: requests can no longer name it, running ones finish with it, its slot goes
        first when another adapter needs one. LoRAError (404) for an unknown name."""
        served = self._served.pop(name, None)
        if served is None:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", status=404)
        served.removed = True
        logger.info("LoRA adapter %r unloaded", name)
        return served

    def registered(self) -> list[ServedLoRA]:
        return list(self._served.values())

    # -- the step ----------------------------------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
        """Put every adapter of the step's rows into a slot and set which slot each token uses."""
        needed = {seq.lora for seq in seqs if seq.lora is not None}
        if not needed:
            self.step.clear()
            return
        self._clock += 1
        for served in needed:
            if served.slot is None:
                self._place(served, needed)
            self._last_used[served.slot] = self._clock  # type: ignore[index]
        token_slots: list[int] = []
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            slot = seq.lora.slot if seq.lora is not None else -1
            token_slots.extend([slot] * n)
        self.step.set(token_slots, device=self.device)

    def finish_step(self) -> None:
        """After the forward: no projection may add adapters to a later forward that did not ask for them
        (a profiling run, a CUDA graph capture)."""
        self.step.clear()

    def _place(self, served: ServedLoRA, needed: set[ServedLoRA]) -> None:
        slot = self._free_slot(needed)
        previous = self._slots[slot]
        if previous is not None:
            previous.slot = None
            self.num_evictions += 1
        for (layer, fused), wrapper in self.layers.items():
            parts = len(wrapper.b)
            wrapper.load(slot, [served.adapter.modules.get((layer, fused, p)) for p in range(parts)])
        self._slots[slot] = served
        served.slot = slot
        self.num_slot_loads += 1

    def _free_slot(self, needed: set[ServedLoRA]) -> int:
        for slot, occupant in enumerate(self._slots):
            if occupant is None:
                return slot
        candidates = [slot for slot, occupant in enumerate(self._slots) if occupant not in needed]
        if not candidates:
            raise RuntimeError(
                f"a step needs more than max_loras ({self.config.max_loras}) adapters: the scheduler must not "
                "admit that"
            )
        removed = [slot for slot in candidates if self._slots[slot].removed]  # type: ignore[union-attr]
        return removed[0] if removed else min(candidates, key=self._last_used.__getitem__)


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return a == b
