"""LoRA adapters served beside the base model: many adapters and the base model's own rows in every batch step.

`LoRARequest` names an adapter (vLLM's class); `adapter` reads PEFT directories; `layers` holds the batched
product; `manager` registers adapters and swaps them into the model's slots.
"""

from structgen.lora.errors import LoRAError
from structgen.lora.request import LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
