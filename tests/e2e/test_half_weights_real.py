"""A real `hearth serve` of a model that ships safetensors alone, at its default
`--quantization`: a bf16 checkpoint runs its own weights in 16 bits on the C kernels
(/version says so), and with a float32 KV cache (the default float16 keys / int8 values
round the cache, within the quality bar but not token for token on random weights) its
greedy completions are transformers' on the same directory (the weights are exactly the
checkpoint's; only the order of float32 sums differs); streamed chat included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.tokenizer import Tokenizer
from tests.e2e.clients import client
from tests.e2e.server import Server, start_server
from tests.engine.tiny_models import COMMON, SERVED_VOCAB, save_random_config
from tests.handlers.handlers_testing import EOS_ID, build_tiny_model

pytestmark = pytest.mark.slow
ops = pytest.importorskip("kernels.cpu.ops")
if not ops.available():
    pytest.skip("host has no AVX2: the C kernels do not run here", allow_module_level=True)


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Server]]:
    directory = tmp_path_factory.mktemp("bf16-llama")
    build_tiny_model(directory)  # the handler tests' tokenizer and ChatML template
    config = LlamaConfig(**{**COMMON, "vocab_size": SERVED_VOCAB}, head_dim=32)
    save_random_config(config, directory).to(torch.bfloat16).save_pretrained(directory)
    server = start_server(
        tmp_path_factory.mktemp("bf16-logs"), str(directory), "--served-model-name", "tiny",
        "--max-model-len", "128", "--kv-cache-dtype", "float32",
    )  # fmt: skip
    yield directory, server
    server.stop()


def test_version_names_the_16_bit_path(bf16_server) -> None:
    _, server = bf16_server
    version = httpx.get(server.url + "/version", timeout=30).json()
    assert version["quantization"] in ("gguf", "gguf-bf16")  # gguf-bf16 on AMX / AVX512-BF16
    assert version["kernels"].startswith("16-bit weights (")
    assert "bf16" in version["kernels"] and "rounded" not in version["kernels"]


def test_greedy_completion_is_transformers(bf16_server) -> None:
    directory, server = bf16_server
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tok = Tokenizer(directory)
    gen = torch.Generator().manual_seed(5)
    sdk = client(server)
    for n in (11, 30):
        prompt = torch.randint(3, 400, (n,), generator=gen).tolist()
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, n, dtype=torch.long),
                max_new_tokens=10, do_sample=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
            )[0, n:].tolist()  # fmt: skip
        got = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True).rstrip("\ufffd")
        assert got.usage.completion_tokens == len(ref)


def test_chat_streamed_and_not(bf16_server) -> None:
    _, server = bf16_server
    sdk = client(server)
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    full = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert full.usage.completion_tokens >= 1
    stream = sdk.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
