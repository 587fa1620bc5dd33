"""The `structgen` subcommands, one module each; `structgen.cli` only wires them into argparse."""
