"""The switches of structured outputs that always finish, shared by `serve`, `run-batch`, `generate` and
`validate`: each command that builds a `StructuredOutputConfig` takes the same two flags and passes them on
unchanged."""

from __future__ import annotations

import argparse


def add_structured_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-structured-budget-closing",
        dest="structured_budget_closing",
        action="store_false",
        help="let max_tokens cut JSON Schema / json_object / tool-call outputs instead of closing them on their "
        "shortest valid completion as the tokens left run out (a request can still ask for either with "
        "structured_outputs.close_at_budget)",
    )
    parser.add_argument(
        "--no-structured-loop-guard",
        dest="structured_loop_guard",
        action="store_false",
        help="let the model repeat the same tokens inside a structured value instead of ending the value "
        "(a request can still ask for either with structured_outputs.loop_guard)",
    )


def structured_switches(args: argparse.Namespace) -> dict[str, bool]:
    """The `StructuredOutputConfig` fields the flags set."""
    return {"close_at_budget": args.structured_budget_closing, "loop_guard": args.structured_loop_guard}
