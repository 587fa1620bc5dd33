"""The LoRA flags `serve` and `run-batch` share, as vLLM spells them: `--enable-lora`, `--lora-modules`,
`--max-loras`, `--max-lora-rank`, `--max-cpu-loras`.

`--lora-modules` takes `name=path` items and JSON objects (`{"name": ..., "path": ..., "base_model_name": ...}`),
several per flag and the flag repeatable, and turns LoRA on by itself. Everything that can be checked without the
model (the form, a name given twice or shadowing the base model, a directory that is not there) is a ValueError
here, before seconds go into loading the model; the adapter's own files are checked when the engine loads them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structgen.config import LoRAConfig
    from structgen.lora import LoRARequest

_MODULE_KEYS = {"name", "path", "base_model_name"}


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model: requests choose one by `model`, and "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH|JSON",
        help='LoRA adapters (PEFT directories) loaded at start: name=path or \'{"name": ..., "path": ..., '
        '"base_model_name": ...}\' (several allowed; implies --enable-lora)',
    )
    parser.add_argument(
        "--max-loras", type=int, default=None, help="adapters one step can run at once (default 4)"
    )
    parser.add_argument(
        "--max-lora-rank", type=int, default=None, help="the highest rank an adapter may have (default 16)"
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters registered at most, loaded or not (default: no limit)",
    )


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The `LoRAConfig` the flags ask for; None when LoRA is off (ValueError for a size flag without it)."""
    from structgen.config import LoRAConfig

    sizes = {
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }
    given = {key: value for key, value in sizes.items() if value is not None}
    if not (args.enable_lora or args.lora_modules):
        if given:
            # Without LoRA nothing reads them: silently ignoring them would hide a missing --enable-lora.
            flag = "--" + next(iter(given)).replace("_", "-")
            raise ValueError(f"{flag} needs --enable-lora (or --lora-modules)")
        return None
    config = LoRAConfig(**given)
    count = len(args.lora_modules or ())
    if config.max_cpu_loras is not None and count > config.max_cpu_loras:
        raise ValueError(
            f"--lora-modules names {count} adapters, more than --max-cpu-loras {config.max_cpu_loras}"
        )
    return config


def lora_modules(args: argparse.Namespace, *, model_name: str) -> list[LoRARequest]:
    """The adapters `--lora-modules` names, each with its own `lora_int_id` (1, 2, ...)."""
    requests: list[LoRARequest] = []
    names: set[str] = set()
    for index, value in enumerate(args.lora_modules or (), start=1):
        request = parse_lora_module(value, lora_int_id=index)
        if request.lora_name == model_name:
            raise ValueError(
                f"--lora-modules: {request.lora_name!r} is the base model's name; give the adapter another"
            )
        if request.lora_name in names:
            raise ValueError(f"--lora-modules names {request.lora_name!r} twice")
        names.add(request.lora_name)
        requests.append(request)
    return requests


def parse_lora_module(value: str, *, lora_int_id: int = 1) -> LoRARequest:
    """One `--lora-modules` item: `name=path` or a JSON object (ValueError naming what is wrong)."""
    from structgen.lora import LoRARequest

    text = value.strip()
    base_model_name = None
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules: {value!r} is not valid JSON: {error}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"--lora-modules: {value!r} must be a JSON object")
        unknown = sorted(set(spec) - _MODULE_KEYS)
        if unknown:
            raise ValueError(
                f"--lora-modules: unknown keys {unknown} in {value!r}; known: {sorted(_MODULE_KEYS)}"
            )
        name, path, base_model_name = spec.get("name"), spec.get("path"), spec.get("base_model_name")
        if base_model_name is not None and not isinstance(base_model_name, str):
            raise ValueError(f"--lora-modules: base_model_name must be a string in {value!r}")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules takes name=path or a JSON object, got {value!r}")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"--lora-modules: {value!r} has no name")
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"--lora-modules: {value!r} has no path")
    if not Path(path).expanduser().is_dir():
        raise ValueError(f"--lora-modules {name}: no LoRA adapter directory at {path!r}")
    return LoRARequest(name.strip(), lora_int_id, path, base_model_name=base_model_name)
