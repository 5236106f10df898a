"""A real `hearth serve` on each tiny MoE checkpoint (tests/engine/moe_models.py, gpt-oss
among them: sinks, YaRN, alternating windows): the `openai` SDK's chat and completions,
greedy completions token-identical to transformers' `generate`, and /version and
/v1/models naming the architecture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.e2e.server import Server, start_server
from tests.engine.moe_models import CONFIGS, one_thread, save_tiny_moe

pytestmark = pytest.mark.slow

ARCHITECTURES = {
    "gpt-oss": "GptOssForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, server_logs: Path
) -> Iterator[tuple[str, Server, torch.nn.Module, Path]]:
    name = request.param
    model_dir = tmp_path_factory.mktemp(name)
    hf = save_tiny_moe(name, model_dir)
    server = start_server(
        server_logs, str(model_dir), "--served-model-name", "tiny-moe", "--dtype", "float32",
        "--max-model-len", "128", "--workers", "1",
    )  # fmt: skip
    yield name, server, hf, model_dir
    server.stop()


def test_version_and_models_name_the_moe_model(moe_server) -> None:
    name, server, _, _ = moe_server
    version = httpx.get(server.url + "/version", timeout=30).json()
    assert version["architecture"] == ARCHITECTURES[name]
    assert version["quantization"] == "none"
    models = httpx.get(server.v1 + "/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-moe"]
    assert models["data"][0]["architecture"] == ARCHITECTURES[name]


def test_chat_and_completions_answer(moe_server) -> None:
    _, server, _, _ = moe_server
    client = openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120)
    chat = client.chat.completions.create(
        model="tiny-moe",
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 6 and chat.choices[0].message.content
    streamed = client.chat.completions.create(
        model="tiny-moe",
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content


def test_greedy_completion_matches_transformers(moe_server) -> None:
    """Prompt token ids in, the text of the same 12 tokens out as transformers' `generate`."""
    from transformers import AutoTokenizer

    _, server, hf, model_dir = moe_server
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[5, 9, 17, 33, 65, 100, 7], [40, 41], list(range(10, 40))]
    client = openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120)
    reply = client.completions.create(
        model="tiny-moe",
        prompt=prompts,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    for choice, prompt in zip(sorted(reply.choices, key=lambda c: c.index), prompts, strict=True):
        assert choice.finish_reason == "length"
        with torch.no_grad(), one_thread():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )
        want = tok.decode(ref[0, len(prompt) :].tolist(), skip_special_tokens=True)
        assert choice.text == want
