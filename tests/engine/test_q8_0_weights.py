"""A model that ships as safetensors alone, quantized to Q8_0 at load: ``--quantization
q8_0`` (float32 activations), and ``gguf-int8``, whose integer kernels read blocks only.

The contract: the blocks are the ones llama.cpp's converter would write for the same
checkpoint as a Q8_0 GGUF, so the engine computes the same bits as it does from that file
(tokens and logprobs equal, not close); `q8_0` named for a GGUF model is refused; a layer
the kernels can't take keeps its dense weight. (`auto` and the other GGUF modes run such a
model's own weights in 16 bits: tests/engine/test_half_weights.py.)
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.layers.linear import Linear, Shard
from engine.layers.q8_0_weights import QuantizedWeights, dequantize_q8_0, quantize_q8_0
from engine.model_resolver import resolve_model_dir
from tests.engine.engine_runs import assert_same_packing, greedy_runs
from tests.engine.gguf_writer import write_gguf
from tests.engine.tiny_models import COMMON, save_random_config

ops = pytest.importorskip("kernels.cpu.ops")
needs_avx2 = pytest.mark.skipif(
    not ops.available(), reason="host has no AVX2: the C kernels do not run here"
)

VOCAB = 320
"""Room for the GGUF writer's byte-level vocabulary; a multiple of the kernels' row group."""
NEW_TOKENS = 8


def _tied_llama() -> LlamaConfig:
    # head_dim 32: the C attention kernel takes multiples of 32.
    return LlamaConfig(**{**COMMON, "vocab_size": VOCAB}, head_dim=32, tie_word_embeddings=True)


def _tied_qwen3() -> Qwen3Config:
    return Qwen3Config(**{**COMMON, "vocab_size": VOCAB}, head_dim=32, tie_word_embeddings=True)


def _linear(cols: int, rows: int) -> Linear:
    layer = Linear(
        cols, rows, [Shard("model.layers.0.mlp.down_proj", rows)], bias=False,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows, cols, generator=torch.Generator().manual_seed(5)))
    return layer


def test_quantized_rows_are_gguf_py_blocks_in_chunks_and_the_weight_becomes_them() -> None:
    """Rows past one chunk (1,024) are quantized like the first ones; the layer's weight is
    replaced by exactly the blocks' dequantized values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weight = torch.randn(1032, 96, generator=torch.Generator().manual_seed(3)) * 0.1
    weight[5] = 0.0  # an all-zero block: scale 0, values 0
    raw = quantize_q8_0(weight)
    assert np.array_equal(raw, quantize(weight.numpy(), GGMLQuantizationType.Q8_0))
    layer = _linear(96, 1032)
    with torch.no_grad():
        layer.weight.copy_(weight)
    laid = QuantizedWeights().rows(layer, row_multiple=8)
    assert laid.kind == "q8_0" and np.array_equal(laid.joined(), raw)
    assert torch.equal(layer.weight.detach(), dequantize_q8_0(raw))
    assert not torch.equal(layer.weight.detach(), weight)  # it did round


def test_layers_the_kernels_cannot_take_keep_their_weight() -> None:
    """Columns not whole 32-blocks, or rows not whole groups (a two-label classifier head):
    no blocks, weight untouched."""
    for rows, cols in ((16, 48), (2, 64)):
        layer = _linear(cols, rows)
        before = layer.weight.detach().clone()
        assert QuantizedWeights().rows(layer, row_multiple=8) is None
        assert torch.equal(layer.weight.detach(), before)


def _run(core: EngineCore, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return greedy_runs(core, prompts, NEW_TOKENS)


def _core(model_dir: Path, quantization: str) -> EngineCore:
    return EngineCore(
        EngineConfig(model=str(model_dir), quantization=quantization, max_model_len=64)
    )


def _checkpoint_and_its_q8_0_gguf(config, tmp_path: Path) -> Path:
    """A random checkpoint in ``tmp_path/hf`` and the directory the engine converts its
    Q8_0 GGUF (written as llama.cpp would) into; both with the GGUF's vocabulary."""
    save_random_config(config(), tmp_path / "hf")
    gguf_path = write_gguf(tmp_path / "hf", tmp_path / "model.gguf", qtype="Q8_0")
    converted = Path(resolve_model_dir(str(gguf_path), str(tmp_path / "cache")))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, tmp_path / "hf" / name)
    return converted


@pytest.fixture(scope="module")
def q8_0_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Any], tuple[Path, Path]]:
    """`_checkpoint_and_its_q8_0_gguf` once per config for the module (each conversion is a
    child process, ~6 s of imports): config -> (its directory, the converted one)."""
    made: dict[Any, tuple[Path, Path]] = {}

    def get(config: Any) -> tuple[Path, Path]:
        if config not in made:
            root = tmp_path_factory.mktemp(config.__name__.strip("_"))
            made[config] = (root, _checkpoint_and_its_q8_0_gguf(config, root))
        return made[config]

    return get


@needs_avx2
@pytest.mark.parametrize("mode", ["q8_0", "gguf-int8"])
@pytest.mark.parametrize("config", [_tied_llama, _tied_qwen3], ids=["llama", "qwen3"])
def test_safetensors_model_computes_what_its_q8_0_gguf_computes(
    config, mode: str, q8_0_models
) -> None:
    root, converted = q8_0_models(config)
    quantized = _core(root / "hf", mode)
    from_file = _core(converted, "gguf" if mode == "q8_0" else mode)  # the file's own blocks
    assert quantized.backends.quantization == mode
    assert "quantized at load" in quantized.backends.description
    assert "quantized at load" not in from_file.backends.description
    assert all(m.packed is not None for m in quantized.model.modules() if isinstance(m, Linear))
    if mode == "q8_0":  # the same blocks, packed the same way
        assert_same_packing(quantized, from_file)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 33)]
    got = _run(quantized, prompts)
    assert got == _run(from_file, prompts)
    # ...and not what the exact float32 model computes (the weights were rounded).
    exact = _core(root / "hf", "none")
    assert [lp for _, lp in _run(exact, prompts)] != [lp for _, lp in got]


@needs_avx2
def test_q8_0_is_refused_for_a_gguf_model(q8_0_models) -> None:
    _, converted = q8_0_models(_tied_llama)
    with pytest.raises(ValueError, match="q8_0 quantizes a model that ships no GGUF"):
        _core(converted, "q8_0")
