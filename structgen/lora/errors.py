"""`LoRAError`: an adapter that cannot be served (no torch needed to name or catch it)."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served: what is wrong with it, in words a user can act on. `status` is the
    HTTP status the server answers it with (404: nothing at the path or no such adapter; 400 otherwise) and `code`
    the error body's code (default: `lora_not_found` for a 404, `invalid_lora_adapter` otherwise)."""

    def __init__(self, message: str, *, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code or ("lora_not_found" if status == 404 else "invalid_lora_adapter")
