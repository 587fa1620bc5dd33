"""A checkpoint's first layers as a checkpoint of their own: a draft model that shares the target's tokenizer.

Speculative decoding needs a smaller model with the target's vocabulary; where none exists, the target's own
first `num_layers` decoder layers with its embeddings, final norm and lm_head make one (early exit, as in
self-speculative decoding). Untrained for it, such a draft agrees with its full model less often than a
distilled one would, but it is the draft any checkpoint has. The tokenizer and generation files are copied as
they are; `config.json` gets the new layer count.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def write_truncated_checkpoint(source_dir: str | Path, target_dir: str | Path, *, num_layers: int) -> Path:
    """Write `source_dir`'s first `num_layers` layers (a single-file or sharded safetensors checkpoint) into
    `target_dir`; returns it. ValueError for a layer count the source does not have."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, target = Path(source_dir), Path(target_dir)
    config = json.loads((source / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in 1..{total} for {source}, got {num_layers}")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source} has no .safetensors weights")
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                match = _LAYER.match(name)
                if match is None or int(match.group(1)) < num_layers:
                    tensors[name] = handle.get_tensor(name)
    target.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "sliding_window_layers"):  # per-layer lists some configs carry
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    for name in _COPIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return target
