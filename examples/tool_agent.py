"""A tool-calling agent loop: the model calls typed Python functions, structgen's client runs them with validated
arguments, sends the results back and stops when the model answers in text (or after --max-steps rounds).

    python examples/tool_agent.py --base-url http://127.0.0.1:8000 --question "What is the weather in Paris?"
"""

from __future__ import annotations

import argparse
import os
from typing import Annotated, Literal

from pydantic import Field

from structgen.client import Client

FORECASTS = {"paris": ("sunny", 21), "oslo": ("snow", -3), "lisbon": ("clear", 24)}


def get_weather(city: Annotated[str, Field(max_length=20)], unit: Literal["celsius", "fahrenheit"]) -> dict:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. Paris.
        unit: The temperature unit to answer in.
    """
    sky, celsius = FORECASTS.get(city.strip().lower(), ("cloudy", 15))
    temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
    return {"city": city, "sky": sky, "temperature": temperature, "unit": unit}


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a small tool-calling agent.")
    parser.add_argument("--base-url", default=os.environ.get("STRUCTGEN_BASE_URL"))
    parser.add_argument("--question", default="What is the weather in Paris?")
    parser.add_argument("--max-steps", type=int, default=2)
    args = parser.parse_args()
    client = Client(args.base_url)
    run = client.call_tools(
        [get_weather],
        messages=[{"role": "user", "content": args.question}],
        tool_choice="required",  # the first round must call a tool; later rounds may answer
        parallel_tool_calls=False,  # one call per round (small models otherwise repeat the same call)
        run_tools=True,
        max_steps=args.max_steps,
        temperature=0,
        max_tokens=48,
    )
    for call in run.calls:
        print(f"call: {call.name}({call.arguments.model_dump_json()}) -> {call.result}")
    print(f"answer: {run.content}" if run.content is not None else f"stopped after {run.steps} steps")
    client.close()


if __name__ == "__main__":
    main()
