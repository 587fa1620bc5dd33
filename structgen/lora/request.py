"""`LoRARequest`: which adapter a request runs with, named as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, with the id and the PEFT directory vLLM's API carries beside it.

    The name is what requests choose it by (the server's `model`); a request naming an adapter the engine does
    not hold yet loads it from `lora_path` first. `lora_int_id` is vLLM's numeric handle (> 0), kept for its
    users' code; `base_model_name` is what `/v1/models` reports as the adapter's parent.
    """

    lora_name: str
    lora_int_id: int = 1
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError("a LoRA adapter needs a non-empty name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
