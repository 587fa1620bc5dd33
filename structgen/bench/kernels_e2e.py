"""End-to-end decode for `structgen.bench.kernels`: our model (Triton attention, CUDA graphs) against Hugging Face
`generate` on the same random weights, and against the bandwidth floor.

Hugging Face's `LlamaForCausalLM` is built with random weights directly on the device, and our model loads the
same tensors through its checkpoint loader. Our decode loop is the engine's forward path without the scheduler:
prompts are prefilled through the paged cache, then every step runs the model on one token per sequence
(replaying a captured CUDA graph on a GPU) and takes the greedy token. HF's decode rate is measured as
(generate N tokens - generate 1 token) so its prefill is excluded too. The floor is the time to read every weight
once per step at the measured copy bandwidth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
LLAMA3_1B = LLAMA3_8B | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
TINY = LLAMA3_8B | {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BLOCK_SIZE = 16
PREFILL_SEQS = 16  # sequences per prefill forward


@dataclass(slots=True)
class E2ERow:
    batch: int
    ours_tok_s: float
    hf_tok_s: float
    floor_tok_s: float
    ours_step_ms: float
    first_token_agreement: float  # share of sequences whose first greedy token is HF's
    # The prefill's last-position logits against HF's forward on the same prompts: ‖ours − HF‖ / ‖HF‖, and
    # the agreement on the rows where HF's top two logits lie further apart than the dtype's rounding allows
    # (`compare_logits`: there a different greedy token means a wrong result, not rounding).
    logits_rel_err: float = float("nan")
    decisive_agreement: float = float("nan")
    decisive_rows: int = 0


def build_models(hf_config: dict[str, Any], *, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """(HF model, our model) sharing one set of random weights."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from structgen.attention import get_attention_backend
    from structgen.models.architectures import create_model
    from structgen.models.config import ModelConfig

    torch.manual_seed(0)
    with torch.device(device):
        hf = HFLlama(LlamaConfig(**hf_config)).to(dtype).eval()
    ours = create_model(
        ModelConfig.from_hf_config(hf_config),
        dtype=dtype,
        device=device,
        attn_backend=get_attention_backend(device, name="triton"),
    )
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def our_decode(
    model: Any, prompts: torch.Tensor, *, steps: int, warmup: int, graphs: bool
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(seconds per decode step, first greedy token of each sequence, the prefill's last-position logits) for a
    batch of equal-length prompts."""
    from structgen.attention import AttentionMetadata, allocate_kv_cache
    from structgen.engine.cuda_graphs import CUDAGraphRunner

    config, device = model.config, prompts.device
    batch, prompt_len = prompts.shape
    per_seq = -(-(prompt_len + warmup + steps) // BLOCK_SIZE)
    caches = allocate_kv_cache(
        num_layers=config.num_hidden_layers,
        num_blocks=batch * per_seq,
        block_size=BLOCK_SIZE,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=next(model.parameters()).dtype,
        device=device,
    )
    tables = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, per_seq)

    def metadata(rows: slice, start: int, length: int) -> AttentionMetadata:
        """`length` new tokens at positions start.. for each sequence in `rows`."""
        n = len(range(batch)[rows])
        positions = torch.arange(start, start + length, device=device)
        slots = tables[rows].long()[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        end = start + length
        return AttentionMetadata(
            slot_mapping=slots.flatten(),
            block_tables=tables[rows],
            context_lens=torch.full((n,), end, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, n * length + 1, length, dtype=torch.int32, device=device),
            max_query_len=length,
            max_context_len=end,
            block_size=BLOCK_SIZE,
            query_lens_cpu=[length] * n,
            context_lens_cpu=[end] * n,
        )

    tokens = torch.empty(batch, dtype=torch.long, device=device)
    last_logits = torch.empty(batch, config.vocab_size, dtype=torch.float32, device=device)
    for first in range(0, batch, PREFILL_SEQS):
        rows = slice(first, min(first + PREFILL_SEQS, batch))
        positions = torch.arange(prompt_len, device=device).repeat(len(range(batch)[rows]))
        hidden = model(prompts[rows].flatten(), positions, caches, metadata(rows, 0, prompt_len))
        last_logits[rows] = model.compute_logits(hidden[prompt_len - 1 :: prompt_len]).float()
        tokens[rows] = last_logits[rows].argmax(-1)
    first_tokens = tokens.clone()
    runner = (
        CUDAGraphRunner(
            model, caches, block_size=BLOCK_SIZE, max_context_len=per_seq * BLOCK_SIZE, device=device
        )
        if graphs
        else None
    )

    def step(position: int) -> None:
        md = metadata(slice(None), position, 1)
        positions = torch.full((batch,), position, dtype=torch.long, device=device)
        if runner is not None and runner.can_run(md):
            hidden = runner.run(tokens, positions, md)
        else:
            hidden = model(tokens, positions, caches, md)
        tokens.copy_(model.compute_logits(hidden).argmax(-1))

    for i in range(warmup):  # captures the graph, compiles the kernels
        step(prompt_len + i)
    _sync(device)
    start = time.perf_counter()
    for i in range(steps):
        step(prompt_len + warmup + i)
    _sync(device)
    return (time.perf_counter() - start) / steps, first_tokens, last_logits


@torch.inference_mode()
def hf_decode(hf: Any, prompts: torch.Tensor, *, steps: int) -> tuple[float, torch.Tensor]:
    """(seconds per decode step, first greedy token) of HF `generate`, its prefill subtracted out."""

    def generate(n: int) -> tuple[float, torch.Tensor]:
        _sync(prompts.device)
        start = time.perf_counter()
        out = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        _sync(prompts.device)
        return time.perf_counter() - start, out[:, prompts.shape[1]]

    generate(2)  # warm-up
    one, first_tokens = generate(1)
    many, _ = generate(steps + 1)
    return max(many - one, 1e-9) / steps, first_tokens


def rounding_tolerance(dtype: torch.dtype) -> float:
    """The relative logit error a correct forward may show in `dtype`: float32 arithmetic lands far under 1e-3,
    bf16 operands between 1e-3 and 1e-2 (taken at its upper end, and doubled)."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def compare_logits(ours: torch.Tensor, ref: torch.Tensor, *, tolerance: float) -> tuple[float, int, float]:
    """(‖ours − ref‖ / ‖ref‖, decisive rows, greedy agreement on them). A row is decisive when the reference's
    top two logits lie further apart than the rounding `tolerance` (relative to the row's largest logit) allows
    twice over: there a correct forward in that precision keeps the reference's greedy token, and a different
    one means a wrong result. (Decisiveness is the reference's own margin, never the two sides' difference:
    measured by the difference, a wrong row would only drop out.)"""
    diff = ours.double() - ref.double()
    err = float(diff.norm() / ref.double().norm().clamp(min=1e-30))
    top2 = ref.double().topk(2, dim=-1).values
    scale = ref.double().abs().amax(dim=-1)
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * tolerance * scale
    same = ours.argmax(-1) == ref.argmax(-1)
    count = int(decisive.sum())
    return err, count, float(same[decisive].float().mean()) if count else float("nan")


@torch.inference_mode()
def against_hf(
    hf: Any, prompts: torch.Tensor, ours_logits: torch.Tensor, *, dtype: torch.dtype
) -> tuple[float, int, float]:
    """`compare_logits` of our prefill's last-position logits against HF's forward on the same prompts."""
    hf_logits = hf(prompts, logits_to_keep=1).logits[:, -1].float()
    return compare_logits(ours_logits, hf_logits, tolerance=rounding_tolerance(dtype))


def run_e2e(*, device: torch.device, quick: bool, cpu_check: bool, copy_bps: float) -> list[E2ERow]:
    if cpu_check:
        hf_config, dtype, batches, prompt_len, steps, hf_steps = TINY, torch.float32, (1, 3), 8, 3, 2
    elif quick:
        hf_config, dtype, batches, prompt_len, steps, hf_steps = (
            LLAMA3_1B,
            torch.bfloat16,
            (1, 8, 64, 256),
            128,
            32,
            8,
        )
    else:
        hf_config, dtype, batches, prompt_len, steps, hf_steps = (
            LLAMA3_8B,
            torch.bfloat16,
            (1, 8, 64, 256),
            128,
            64,
            16,
        )
    hf, ours = build_models(hf_config, device=device, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    floor_step = weight_bytes / copy_bps
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for batch in batches:
        prompts = torch.randint(3, hf_config["vocab_size"], (batch, prompt_len), generator=gen, device=device)
        ours_step, ours_first, ours_logits = our_decode(
            ours, prompts, steps=steps, warmup=3, graphs=device.type == "cuda"
        )
        hf_step, hf_first = hf_decode(hf, prompts, steps=hf_steps)
        err, decisive, agree = against_hf(hf, prompts, ours_logits, dtype=dtype)
        del ours_logits
        rows.append(
            E2ERow(
                batch=batch,
                ours_tok_s=batch / ours_step,
                hf_tok_s=batch / hf_step,
                floor_tok_s=batch / floor_step,
                ours_step_ms=ours_step * 1e3,
                first_token_agreement=float((ours_first == hf_first).float().mean()),
                logits_rel_err=err,
                decisive_agreement=agree,
                decisive_rows=decisive,
            )
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"e2e model: {hf_config['num_hidden_layers']} layers, hidden {hf_config['hidden_size']}, {weight_bytes / 1e9:.2f} GB of {dtype} weights"
    )
    return rows


@dataclass(slots=True)
class Float32Check:
    """The same comparison in float32, where rounding cannot explain a difference: a 1B-shaped model (16 layers)
    under the Triton kernels and HF's own attention; bf16's many flat random logits make its agreement weak."""

    layers: int
    batch: int
    logits_rel_err: float
    decisive_agreement: float
    decisive_rows: int

    def summary(self) -> str:
        return (
            f"float32 check ({self.layers} layers, batch {self.batch}): logits rel err {self.logits_rel_err:.1e},"
            f" same greedy token on {100 * self.decisive_agreement:.0f}% of {self.decisive_rows} decisive rows"
        )


def float32_check(*, device: torch.device, cpu_check: bool) -> Float32Check:
    hf_config, batch, prompt_len = (TINY, 3, 8) if cpu_check else (LLAMA3_1B, 8, 128)
    hf, ours = build_models(hf_config, device=device, dtype=torch.float32)
    gen = torch.Generator(device=device).manual_seed(2)
    prompts = torch.randint(3, hf_config["vocab_size"], (batch, prompt_len), generator=gen, device=device)
    _, _, ours_logits = our_decode(ours, prompts, steps=1, warmup=1, graphs=device.type == "cuda")
    err, decisive, agree = against_hf(hf, prompts, ours_logits, dtype=torch.float32)
    del hf, ours
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Float32Check(hf_config["num_hidden_layers"], batch, err, agree, decisive)


def print_e2e(rows: list[E2ERow]) -> None:
    header = (
        "batch",
        "ours tok/s",
        "HF tok/s",
        "vs HF",
        "floor tok/s",
        "floor / ours step",
        "step ms",
        "same 1st tok",
        "logits err",
        "decisive same",
    )
    print()
    print("  ".join(header))
    for r in rows:
        cells = (
            str(r.batch),
            f"{r.ours_tok_s:.0f}",
            f"{r.hf_tok_s:.0f}",
            f"{r.ours_tok_s / r.hf_tok_s:.1f}x",
            f"{r.floor_tok_s:.0f}",
            f"{r.floor_tok_s / r.ours_tok_s:.2f}x",
            f"{r.ours_step_ms:.2f}",
            f"{100 * r.first_token_agreement:.0f}%",
            f"{r.logits_rel_err:.1e}",
            f"{100 * r.decisive_agreement:.0f}% of {r.decisive_rows}",
        )
        print("  ".join(c.rjust(len(h)) for c, h in zip(cells, header, strict=True)))
