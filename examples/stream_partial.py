"""Stream a structured answer and watch the object fill in, field by field, as tokens arrive.

    python examples/stream_partial.py --base-url http://127.0.0.1:8000

Partial values are plain dicts (strings show their prefix so far; numbers appear once complete); the last
value is the validated Pydantic model.
"""

from __future__ import annotations

import argparse
import json
import os

from pydantic import BaseModel, Field

from structgen.client import Client


class Recipe(BaseModel):
    dish: str = Field(max_length=30)
    servings: int = Field(ge=1, le=12)
    ingredients: list[str] = Field(min_length=1, max_length=3)


def run(base_url: str | None) -> Recipe:
    prompt = "Give a short recipe for pancakes as JSON: the dish, the servings and up to 3 ingredients."
    with Client(base_url) as client:
        for value in client.stream_parse(Recipe, prompt=prompt, temperature=0, max_tokens=80):
            if isinstance(value, Recipe):
                print("final:", value.model_dump_json())
                return value
            print("partial:", json.dumps(value))
    raise AssertionError("stream_parse always ends with the validated value")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("STRUCTGEN_BASE_URL"))
    run(parser.parse_args().base_url)
