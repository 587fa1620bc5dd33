"""The batched LoRA product: every projection adds the adapters of a step's rows itself, no weights merged.

Each adapted projection keeps `max_loras` slots of zero-padded weights (`a`: [slots, parts, rank, in], and per
part `b`: [slots, rank, out]; the scaling is already in `b`). A step that carries adapter rows sets `LoRAStep`:
the slot of each of its tokens (-1 for the base model's). On the CPU the native kernel (`kernels/cpu_lora.py`)
then adds each token's own adapter after the projection's kernel, reading only that slot's weights and ranks
(from its own layouts of A and B, `ka` and `kb`); elsewhere (the GPU, no compiler) a dense product over the
step's slot range does it in torch: the shrink `x @ a[lo:hi]^T`, a mask zeroing every slot but the token's own,
and per part the expand into that part's output columns. A step without adapter rows pays one bit test per
projection. Costs on SmolLM2 and 2 CPU cores: BENCHMARKS.md "LoRA adapters".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from structgen.lora.adapter import LoRAModule, TargetShapes

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LoRAStep:
    """Which adapter slot each of this step's tokens uses; shared by every `LoRALinear` of the model."""

    token_slots: torch.Tensor | None = (
        None  # [tokens] int32 on the model's device, -1: base; None: no adapters
    )
    lo: int = 0  # the step's slots lie in lo..hi-1
    hi: int = 0
    slots: frozenset[int] = frozenset()
    slot_bits: int = 0  # the step's slots as a bit set, checked by every projection on every call
    uniform: bool = False  # every token uses the single slot lo: the dense path needs no mask
    _mask: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.token_slots is not None

    def set(self, token_slots: list[int], *, device: torch.device) -> None:
        """`token_slots[i]`: the slot of token i of the step's flattened batch, -1 for the base model."""
        used = {s for s in token_slots if s >= 0}
        if not used:
            self.clear()
            return
        self.lo, self.hi = min(used), max(used) + 1
        self.slots = frozenset(used)
        self.slot_bits = sum(1 << s for s in used)
        self.uniform = len(used) == 1 and min(token_slots) >= 0
        self.token_slots = torch.tensor(token_slots, dtype=torch.int32).to(device)
        self._mask = None

    def clear(self) -> None:
        self.token_slots, self._mask = None, None
        self.slots, self.slot_bits, self.uniform = frozenset(), 0, False

    def dense_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[tokens, hi - lo, 1, 1]: one where a token uses that slot (built once a step, for the torch path)."""
        if self._mask is None or self._mask.dtype != dtype:
            assert self.token_slots is not None
            index = self.token_slots.long() - self.lo
            span = torch.arange(self.hi - self.lo, device=index.device)
            mask = (index[:, None] == span[None, :]).to(dtype)
            self._mask = mask.view(len(index), self.hi - self.lo, 1, 1)
        return self._mask


@dataclass(slots=True)
class LoRALinear:
    """A projection's kernel plus the LoRA slots of its parts (q/k/v of a fused qkv, gate/up, or one)."""

    base: Linear
    step: LoRAStep
    a: torch.Tensor  # [slots, parts, rank, in]
    b: list[torch.Tensor]  # per part [slots, rank, out]
    # The same B in the CPU kernel's layout (`cpu_lora.blocked`: [slots, out / 16, rank, 16]), when `native`.
    kb: list[torch.Tensor]
    # A by input pairs (`cpu_lora.by_input_pairs`) for the kernel's bf16 shrink; empty where it does not apply.
    ka: torch.Tensor
    offsets: list[int]  # each part's first output column
    ranks: torch.Tensor  # [slots, parts] int32 (CPU): each slot's rank per part, 0 where it has none
    filled: list[set[int]] = field(default_factory=list)  # per part: the slots holding weights there
    filled_bits: int = 0  # the slots holding weights in any part, as a bit set
    native: bool = False  # the segmented CPU kernel (`kernels/cpu_lora.py`), else the dense torch path
    op: Callable[..., None] | None = (
        None  # the kernel's op overload, bound once (called ~4 times a layer a step)
    )

    @classmethod
    def build(
        cls,
        base: Linear,
        step: LoRAStep,
        parts: tuple[tuple[int, int], ...],
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        native: bool,
    ) -> LoRALinear:
        in_features = parts[0][0]
        offsets, start = [], 0
        for _, out in parts:
            offsets.append(start)
            start += out
        return cls(
            base=base,
            step=step,
            a=torch.zeros(num_slots, len(parts), max_rank, in_features, dtype=dtype, device=device),
            b=[torch.zeros(num_slots, max_rank, out, dtype=dtype, device=device) for _, out in parts],
            kb=[
                torch.zeros(num_slots, -(-out // 16), max_rank, 16, dtype=dtype, device=device)
                for _, out in parts
            ]
            if native
            else [],
            ka=torch.zeros(
                (num_slots, in_features // 2, len(parts) * max_rank, 2)
                if native and dtype == torch.bfloat16 and in_features % 2 == 0
                else (0,),
                dtype=dtype,
                device=device,
            ),
            offsets=offsets,
            ranks=torch.zeros(num_slots, len(parts), dtype=torch.int32),
            filled=[set() for _ in parts],
            native=native,
            op=torch.ops.structgen_cpu.lora_add.default if native else None,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if not self.filled_bits & step.slot_bits or x.dim() != 2:
            return y  # no adapter rows in the step, or none of the step's adapters touches this projection
        if self.native and x.stride(1) == 1 and y.stride(1) == 1 and x.dtype == self.a.dtype == y.dtype:
            self.op(x, y, self.a, self.kb, self.offsets, step.token_slots, self.ranks, self.ka)
            return y
        return self._dense(x, y)

    def _dense(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every slot of the step's range for every token, the others masked to zero: two matmuls whatever the
        mix of adapters (the GPU's and the no-compiler path; the CPU kernel reads each token's own slot)."""
        step = self.step
        lo, hi = step.lo, step.hi
        tokens, n = x.shape[0], hi - lo
        a = self.a[lo:hi]
        num_parts, rank = a.shape[1], a.shape[2]
        shrunk = torch.mm(x.to(a.dtype), a.view(-1, a.shape[-1]).t()).view(tokens, n, num_parts, rank)
        if not step.uniform:
            shrunk.mul_(step.dense_mask(shrunk.dtype))
        for p, slots in enumerate(self.filled):
            if slots.isdisjoint(step.slots):
                continue
            b = self.b[p][lo:hi]
            width = b.shape[-1]
            update = torch.mm(shrunk[:, :, p, :].reshape(tokens, n * rank), b.view(n * rank, width))
            y.narrow(1, self.offsets[p], width).add_(update.to(y.dtype))
        return y

    def load(self, slot: int, modules: list[LoRAModule | None]) -> None:
        """Put an adapter's parts into `slot` (None: the adapter leaves that part alone)."""
        self.clear(slot)
        for p, module in enumerate(modules):
            if module is None:
                continue
            rank = module.rank
            self.a[slot, p, :rank].copy_(module.a)
            self.b[p][slot, :rank].copy_(module.b.t())
            if self.native:
                from structgen.kernels.cpu_lora import blocked

                self.kb[p][slot] = blocked(self.b[p][slot : slot + 1])[0]
            self.ranks[slot, p] = rank
            self.filled[p].add(slot)
            self.filled_bits |= 1 << slot
        if self.ka.numel():
            from structgen.kernels.cpu_lora import by_input_pairs

            self.ka[slot] = by_input_pairs(self.a[slot : slot + 1])[0]

    def clear(self, slot: int) -> None:
        for p, slots in enumerate(self.filled):
            if slot in slots:
                self.a[slot, p].zero_()
                self.b[p][slot].zero_()
                if self.native:
                    self.kb[p][slot].zero_()
                self.ranks[slot, p] = 0
                slots.discard(slot)
        self.filled_bits &= ~(1 << slot)


# The model's projections an adapter can reach, by the attribute path inside a decoder layer.
_PROJECTIONS = {
    "qkv_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


def attach_lora_layers(
    model: nn.Module, step: LoRAStep, shapes: TargetShapes, *, num_slots: int, max_rank: int
) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every adaptable projection's kernel of `model` (a Llama-style `...ForCausalLM`) in a `LoRALinear`;
    {(layer, fused name): wrapper}. Wrappers from an earlier call are replaced, not stacked. A flat forward
    (`structgen.models.llama_flat`) bound to the old kernels is rebuilt, and told about the step so it keeps
    its all-native decode path for steps without adapter rows."""
    weight = next(model.parameters())
    on_cpu = weight.device.type == "cpu"
    native = on_cpu and weight.dtype in (torch.float32, torch.bfloat16) and _kernel_loads()
    wrappers: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.model.layers):
        for fused, (block, attr) in _PROJECTIONS.items():
            module = getattr(getattr(layer, block), attr)
            kernel = module.kernel
            if isinstance(kernel, LoRALinear):
                kernel = kernel.base
            base = kernel if kernel is not None else functools.partial(F.linear, weight=module.weight)
            wrapper = LoRALinear.build(
                base,
                step,
                shapes.parts[fused],
                num_slots=num_slots,
                max_rank=max_rank,
                dtype=weight.dtype,
                device=weight.device,
                native=native,
            )
            module.kernel = wrapper
            wrappers[(index, fused)] = wrapper
    decoder = model.model
    if getattr(decoder, "flat_forward", None) is not None:
        from structgen.models.llama_flat import enable_flat_forward

        enable_flat_forward(model)
        decoder.flat_forward.lora_step = step
    return wrappers


def _kernel_loads() -> bool:
    from structgen.kernels import cpu_lora

    return cpu_lora.available()
