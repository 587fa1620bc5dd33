"""Helpers for the tensor-parallel tests: random checkpoints, greedy generation through an engine, and waiting
for processes to exit."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from structgen.engine.llm_engine import LLMEngine
from structgen.models.registry import resolve_model
from structgen.sampling_params import SamplingParams

PROMPTS: list[list[int]] = [[1, 2, 3, 4, 5], [7] * 20, [100, 200, 300, 400, 50, 60, 70, 80, 90, 10, 11], [42]]
MAX_TOKENS = 10


def random_checkpoint(architecture: str, overrides: dict[str, Any], out_dir: Path) -> Path:
    """A random HF checkpoint of a tiny config (512 tokens) with tiny's tokenizer, which the engine needs
    (prompts are token ids below 512)."""
    # `paged_harness` lives with the model tests, which may not have been collected yet.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from paged_harness import hf_tiny_model

    hf_tiny_model(architecture, overrides, out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("tiny") / name, out_dir / name)
    return out_dir


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """Every prompt's greedy continuation, all prompts in one batch (prefills and decodes mixed)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": prompt}, params)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    return [finished[f"g{i}"] for i in range(len(prompts))]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after waiting up to `timeout` seconds for them to exit (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
