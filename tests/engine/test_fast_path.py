"""The default CPU fast path (GGUF blocks + C kernels) on the real SmolLM2 file.

Its precision contract, checked here: (1) the packed weights are exactly the file's,
i.e. the float32 weights the exact mode loads; (2) a request's tokens never depend on
load: alone, in one mixed batch, or prefilled in 40-token chunks between other
sequences' decodes, greedy outputs are identical; (3) greedy outputs agree with
transformers' float32 `generate` (only the order of float32 sums differs, so a rare
near-tie may flip; the test names how many may).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from tests.engine.test_greedy_parity import _generate, prompts, reference  # noqa: F401

pytestmark = [pytest.mark.slow]
ops = pytest.importorskip("kernels.cpu.ops")
if not ops.available():
    pytest.skip("host has no AVX2: the fast path does not run here", allow_module_level=True)


def _fast_core(model_dir: str, **overrides):
    from engine.core import EngineCore

    config = EngineConfig(model=model_dir, max_model_len=2048, max_num_seqs=32, **overrides)
    core = EngineCore(config)
    assert core.weights_mode.quantization == "gguf", core.weights_mode
    return core


@pytest.fixture(scope="module")
def fast_core(model_smollm2_dir: str):
    return _fast_core(model_smollm2_dir)


def test_auto_picks_gguf_and_explicit_float32_stays_exact(fast_core, model_smollm2_dir) -> None:
    from engine.core import EngineCore

    assert "q4_1" in fast_core.weights_mode.description
    assert fast_core.model.native is not None
    exact = EngineCore(EngineConfig(model=model_smollm2_dir, dtype="float32", num_kv_blocks=8))
    assert exact.weights_mode.quantization == "none" and exact.model.native is None


def test_packed_weights_are_the_files_weights(model_smollm2_dir: str) -> None:
    """Dequantizing the packed blocks gives back the exact mode's float32 weights bit for
    bit (this also proves the Q/K row order is undone correctly)."""
    from engine.model_loader import load_model
    from engine.models.gguf_weights import gguf_source, pack_gguf_weights

    model, _ = load_model(model_smollm2_dir, torch.float32, torch.device("cpu"))
    packed = pack_gguf_weights(model, gguf_source(model_smollm2_dir))
    assert packed.kinds == {"q4_1": 4 * len(model.model.layers), "q8_0": 1}
    layer, p = model.model.layers[3], packed.layers[3]
    eye = torch.eye(layer.self_attn.qkv_proj.shape[1])
    # x = identity rows: linear(I, W) = W^T exactly (one product per output, no sums).
    got = ops.linear(eye, p.qkv).T
    assert torch.equal(got, layer.self_attn.qkv_proj.detach())
    got = ops.linear(torch.eye(layer.mlp.down_proj.shape[1]), p.down).T
    assert torch.equal(got, layer.mlp.down_proj.detach())


def test_outputs_do_not_depend_on_load(fast_core, model_smollm2_dir, prompts) -> None:  # noqa: F811
    alone = _generate(fast_core, prompts, "alone", at_once=False)
    batched = _generate(fast_core, prompts, "batched", at_once=True)
    chunked_core = _fast_core(
        model_smollm2_dir, max_num_batched_tokens=40, enable_prefix_caching=False
    )
    chunked = _generate(chunked_core, prompts, "chunked", at_once=True)
    assert alone == batched
    assert alone == chunked


def test_greedy_agrees_with_transformers(fast_core, prompts, reference) -> None:  # noqa: F811
    got = _generate(fast_core, prompts, "ref", at_once=True)
    same = [g == r for g, r in zip(got, reference, strict=True)]
    # Common prefix length: a flip at a near-tie changes everything after it.
    prefix = [
        next((i for i, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))
        for g, r in zip(got, reference, strict=True)
    ]
    assert sum(same) >= len(prompts) - 1, (same, prefix)
    assert float(np.mean(prefix)) >= 0.9 * np.mean([len(r) for r in reference]), prefix


def test_one_call_stack_equals_per_op_path(fast_core) -> None:
    """The whole-stack C call and the per-op path run the same kernels in the same order:
    bitwise the same logits."""
    from engine.quality import _window_logits

    ids = list(range(1000, 1100))
    native = fast_core.model.native
    fused = _window_logits(fast_core, ids)
    assert native._fused is not None and native._fused[1] is not None  # the one-call path ran
    key = native._fused[0]
    native._fused = (key, None)  # force the per-op path
    try:
        per_op = _window_logits(fast_core, ids)
    finally:
        native._fused = None
    assert torch.equal(fused, per_op)
