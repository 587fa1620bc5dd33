"""Per-phase timing of engine steps for `structgen bench structured --parts s --breakdown`.

Each named function below is wrapped (on its class, for the duration of a `PhaseTimer.installed()` block only)
with a `time.perf_counter` accumulator. Many of them nest (`Finisher.advance` calls `_accept`, `_forced`, the
budget closer and the loop guard; `TokenMask.apply` calls `ensure_filled`; the processor's `__call__` may fill
rows itself): every phase is *exclusive*, i.e. its own time minus the time of the named phases it called, so
the phases of a step add up to the step and "other" is the step's time minus all of them. Only calls on the
thread that installed the timer count (the mask fill on the mask thread overlaps the forward and shows up as
"mask wait" when the step has to wait for it). Each wrapped call costs ~1 µs of timer overhead, which lands
in the phase that made the call.

A target that does not exist any more (the engine code is being optimized) is skipped and listed under
`missing`, so a renamed function shows up in the report instead of silently falling into "other".
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# (phase, "module:Class.attribute"): several targets may feed one phase. Order = the order of the report.
TARGETS: tuple[tuple[str, str], ...] = (
    ("schedule", "structgen.engine.scheduler:Scheduler.schedule"),
    ("grammar poll + fill start", "structgen.engine.structured:StructuredOutputs.poll"),
    ("grammar poll + fill start", "structgen.engine.structured:StructuredOutputs.prepare"),
    ("inputs", "structgen.engine.model_runner:ModelRunner._prepare"),
    ("forward", "structgen.engine.model_runner:ModelRunner._forward"),
    # ("logits", also the model class's compute_logits): resolved per engine, see `PhaseTimer.install`
    ("logits", "structgen.engine.model_runner:ModelRunner._logits"),
    ("mask wait", "structgen.structured.logits_processor:StructuredLogitsProcessor.__call__"),
    ("mask wait", "structgen.structured.logits_processor:StructuredLogitsProcessor.narrow_rows"),
    ("mask fill now", "structgen.engine.token_mask:TokenMask.ensure_filled"),
    ("mask apply", "structgen.engine.token_mask:TokenMask.apply"),
    ("sampler rest", "structgen.engine.sampler:Sampler.__call__"),
    ("pick", "structgen.engine.sampler:Sampler._pick"),
    ("reject + redraw", "structgen.engine.sampler:Sampler._redraw"),
    ("reject + redraw", "structgen.engine.redraw:Draws.under_mask"),
    ("reject + redraw", "structgen.engine.sampler:Sampler._split_sparse"),
    ("reject + redraw", "structgen.engine.sampler:Sampler._pick_among_allowed"),
    ("accept", "structgen.structured.finishing:Finisher._accept"),
    ("accept", "structgen.structured.request:StructuredRequest.accept"),
    ("jump-forward", "structgen.structured.finishing:Finisher._forced"),
    ("jump-forward", "structgen.structured.request:StructuredRequest.jump_forward"),
    ("budget closing", "structgen.structured.budget_closer:BudgetCloser.step"),
    ("budget closing", "structgen.structured.budget_closer:BudgetCloser.completion_within"),
    ("loop guard", "structgen.structured.loop_guard:LoopGuard.step"),
    ("finisher rest", "structgen.structured.finishing:Finisher.advance"),
    ("detokenize", "structgen.tokenizer.detokenizer:IncrementalDetokenizer.push"),
    ("detokenize", "structgen.tokenizer.detokenizer:IncrementalDetokenizer.flush"),
    ("validate", "structgen.engine.output_processor:OutputProcessor.finish_structured"),
    ("outputs rest", "structgen.engine.output_processor:OutputProcessor.process"),
    ("outputs rest", "structgen.engine.output_processor:OutputProcessor.make_output"),
)
LOGITS = "logits"
OTHER = "other"


def phase_names() -> list[str]:
    """Every phase in report order (the logits after the forward; "other" last)."""
    names = list(dict.fromkeys(phase for phase, _ in TARGETS))
    if LOGITS not in names:
        names.insert(names.index("forward") + 1, LOGITS)
    return [*names, OTHER]


@dataclass(slots=True)
class PhaseTotals:
    """One side's accumulated exclusive seconds per phase, its step time and step count."""

    seconds: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0
    steps: int = 0

    def ms_per_step(self) -> dict[str, float]:
        """Milliseconds per step for each phase; "other" is the step time no named phase accounts for."""
        n = max(self.steps, 1)
        named = {name: self.seconds.get(name, 0.0) for name in phase_names() if name != OTHER}
        rows = {name: 1000 * s / n for name, s in named.items()}
        rows[OTHER] = 1000 * (self.step_s - sum(named.values())) / n
        rows["step"] = 1000 * self.step_s / n
        return {name: round(ms, 3) for name, ms in rows.items()}


@dataclass(slots=True)
class PhaseTimer:
    """Wraps the `TARGETS` with exclusive-time accumulators writing into `current` (swap it per side)."""

    current: PhaseTotals = field(default_factory=PhaseTotals)
    missing: list[str] = field(default_factory=list)
    _frames: list[float] = field(default_factory=list)  # per open call: time spent in named callees
    _patched: list[tuple[Any, str, Any, bool]] = field(default_factory=list)
    _thread: int = 0

    @contextmanager
    def installed(self, models: list[Any]) -> Iterator[PhaseTimer]:
        """Wrap every target (and each model's `compute_logits`) inside the block; restored afterwards."""
        self._thread = threading.get_ident()
        try:
            for phase, target in TARGETS:
                owner = _resolve(target)
                if owner is None:
                    self.missing.append(target)
                else:
                    self._patch(owner, target.rsplit(".", 1)[1], phase)
            for model in models:
                # The model's class, unless the instance carries its own (a bound replacement).
                owner = model if "compute_logits" in vars(model) else type(model)
                if not any(o is owner and a == "compute_logits" for o, a, _, _ in self._patched):
                    self._patch(owner, "compute_logits", LOGITS)
            yield self
        finally:
            for owner, attr, original, own in reversed(self._patched):
                if own:
                    setattr(owner, attr, original)
                else:
                    delattr(owner, attr)  # it was inherited: uncover the base class's again
            self._patched.clear()

    def _patch(self, owner: Any, attr: str, phase: str) -> None:
        own = attr in vars(owner)
        original = vars(owner)[attr] if own else getattr(owner, attr)
        self._patched.append((owner, attr, original, own))
        setattr(owner, attr, self._wrap(phase, original))

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != timer._thread:
                return fn(*args, **kwargs)  # the mask thread, the compile pool: not a step phase
            frames = timer._frames
            frames.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = frames.pop()
                seconds = timer.current.seconds
                seconds[phase] = seconds.get(phase, 0.0) + elapsed - inner
                if frames:
                    frames[-1] += elapsed

        return timed


def _resolve(target: str) -> Any | None:
    """The class named by "module:Class.attr" if it (still) has `attr` as a plain function, else None."""
    module_name, path = target.split(":")
    class_name, attr = path.rsplit(".", 1)
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in class_name.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    # Only functions defined on the class: wrapping a staticmethod or property would change its meaning.
    return (
        owner if callable(vars(owner).get(attr)) and not isinstance(vars(owner)[attr], staticmethod) else None
    )


def format_table(columns: dict[str, dict[str, float]]) -> str:
    """ms per step per phase (`PhaseTotals.ms_per_step` of each side), one column per side."""
    lines = [f"  {'phase (ms/step, exclusive)':28}" + "".join(f"{name:>15}" for name in columns)]
    for row in [*phase_names(), "step"]:
        cells = [column.get(row, 0.0) for column in columns.values()]
        if row not in ("step", OTHER) and not any(cells):
            continue  # a phase neither side went through (e.g. the structured ones of a plain run)
        lines.append(f"  {row:28}" + "".join(f"{cell:15.3f}" for cell in cells))
    if "unconstrained" in columns and "json" in columns:
        lines.append(format_split(model_work_split(columns["unconstrained"], columns["json"])))
    return "\n".join(lines)


# The phases that run the model: what the JSON side's forced runs and new prompts add to a step.
MODEL_PHASES = ("forward", LOGITS)


def model_work_split(plain: dict[str, float], constrained: dict[str, float]) -> dict[str, float]:
    """Where the constrained step's extra time goes (two sides' `PhaseTotals.ms_per_step`, both sampling a token
    per row of the same batch): `model_ms`, the forward and lm_head beyond the plain side's (forced runs and
    new prompts go through the forward; narrow rows make the lm_head cheaper); `rest_ms`, the rest of the step
    beyond the plain side's (the structured work: masks, picks, accepts, jump-forward, closing, checks);
    `ratio_forward_equal`, the plain step over the constrained step with its forward at the plain one's (the
    sampled-only ratio if forced and prompt tokens cost the forward nothing, as extra rows nearly do on a
    memory-bound device; on two compute-bound cores they cost a row each)."""
    model = sum(constrained.get(p, 0.0) - plain.get(p, 0.0) for p in MODEL_PHASES)
    rest = (constrained["step"] - plain["step"]) - model
    forward = constrained.get("forward", 0.0) - plain.get("forward", 0.0)
    return {
        "model_ms": round(model, 3),
        "rest_ms": round(rest, 3),
        "ratio_forward_equal": round(plain["step"] / (constrained["step"] - forward), 3),
    }


def format_split(split: dict[str, float]) -> str:
    """`model_work_split` as one line under a breakdown table."""
    return (
        f"  json - plain: model (forward + logits) {split['model_ms']:+.3f} ms/step, the rest "
        f"{split['rest_ms']:+.3f} ms/step; ratio with the json forward at the plain one's: "
        f"{split['ratio_forward_equal']:.3f}"
    )
