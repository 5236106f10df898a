"""A linear method is chosen per layer without touching the model file: a toy method that
counts its calls (and one that changes the result) is handed to every `Linear` of a
model the way `engine/backends.py` hands out the real ones, and the forward runs it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from engine.attention import PagedAttentionBackend
from engine.layers.attention import bind_attention
from engine.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from kernels.metadata import SeqSpan


class CountingMethod(LinearMethod):
    """Computes exactly as the dense method and counts the calls, per layer."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}
        self.rows = 0
        self._dense = UnquantizedLinearMethod()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        self.calls[id(layer)] = self.calls.get(id(layer), 0) + 1
        self.rows += x.shape[0]
        return self._dense.apply(layer, x)


class NegatingMethod(LinearMethod):
    name = "negating"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return -torch.nn.functional.linear(x, layer.weight, layer.bias)


def _model(cls, config_cls):
    config = config_cls(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=97,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = cls(config, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    shape = (16, 4, model.num_kv_heads, model.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    backend = PagedAttentionBackend(torch.float32)
    bind_attention(model, kv, backend)
    return model, backend


def _logits(model, backend, n: int = 5) -> torch.Tensor:
    meta = backend.build_metadata([SeqSpan(0, n, [0, 1])], list(range(n)), 4, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.arange(3, 3 + n), torch.arange(n), meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize(
    ("cls", "config_cls"), [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)]
)
def test_a_toy_linear_method_runs_every_linear_without_touching_the_model(cls, config_cls) -> None:
    model, backend = _model(cls, config_cls)
    want = _logits(model, backend)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.num_layers + 1  # qkv, o, gate_up, down; lm_head
    counting = CountingMethod()
    for layer in linears:
        layer.method = counting
    got = _logits(model, backend)
    assert torch.equal(got, want)
    assert sorted(counting.calls) == sorted(id(m) for m in linears)
    assert set(counting.calls.values()) == {1}  # each linear once per forward
    assert counting.rows == 5 * 4 * model.num_layers + 5  # every token; the head too


def test_a_method_that_changes_the_result_changes_the_output() -> None:
    """The method really is what computes: a different one gives a different answer."""
    model, backend = _model(LlamaForCausalLM, LlamaConfig)
    want = _logits(model, backend)
    model.lm_head.method = NegatingMethod()
    assert torch.equal(_logits(model, backend), -want)
