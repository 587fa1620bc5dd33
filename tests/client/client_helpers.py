"""Helpers shared by the client tests."""

from __future__ import annotations

from typing import Any

MODEL = "smollm2-135m"
API_KEY = "client-test-key"


def consistent(partial: Any, final: Any) -> bool:
    """Whether `partial` is what some prefix of `final`'s document may show under the documented rule."""
    if isinstance(final, dict):
        return isinstance(partial, dict) and all(
            key in final and consistent(value, final[key]) for key, value in partial.items()
        )
    if isinstance(final, list):
        if not isinstance(partial, list) or len(partial) > len(final):
            return False
        if not partial:
            return True
        *done, last = partial
        return done == final[: len(done)] and consistent(last, final[len(done)])
    if isinstance(final, str):
        return isinstance(partial, str) and final.startswith(partial)
    return partial == final and type(partial) is type(final)
