"""`LoRAError`: an adapter that cannot be served (no torch needed to name or catch it)."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be served: what is wrong with it, in words a user can act on. `status` is the
    HTTP status the server answers it with (404: nothing at the path or no such adapter; 400 otherwise)."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
