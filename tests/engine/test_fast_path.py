"""The default CPU fast path (GGUF blocks + C kernels) on the real SmolLM2 file.

Its precision contract, checked here: (1) the packed weights are exactly the file's,
i.e. the float32 weights the exact mode loads; (2) a request's tokens never depend on
load: alone, in one mixed batch, or prefilled in 40-token chunks between other
sequences' decodes, greedy outputs are identical; (3) greedy outputs agree with
transformers' float32 `generate` (only the order of float32 sums differs, so a rare
near-tie may flip; the test names how many may).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from tests.engine.test_greedy_parity import _generate, assert_agrees_with_reference

pytestmark = [pytest.mark.slow]
ops = pytest.importorskip("kernels.cpu.ops")
if not ops.available():
    pytest.skip("host has no AVX2: the fast path does not run here", allow_module_level=True)


def _fast_core(model_dir: str, **overrides):
    """`--quantization gguf`: the default on hosts without AVX512-BF16, and the batch-invariant
    mode everywhere (elsewhere the default is gguf-bf16: tests/engine/test_tiled_path.py)."""
    from engine.core import EngineCore

    overrides.setdefault("quantization", "gguf")
    config = EngineConfig(model=model_dir, max_model_len=2048, max_num_seqs=32, **overrides)
    core = EngineCore(config)
    assert core.backends.quantization == "gguf", core.backends
    return core


@pytest.fixture(scope="module")
def fast_core(model_smollm2_dir: str):
    return _fast_core(model_smollm2_dir)


def test_gguf_uses_the_blocks_and_explicit_float32_stays_exact(
    fast_core, model_smollm2_dir
) -> None:
    """The choice is made once, on the layers: every linear the file holds in blocks gets
    the GGUF method, the elementwise layers the C kernels, attention the C backend; an
    explicit float32 keeps every layer on the exact torch path."""
    from engine.attention import CpuAttentionBackend, PagedAttentionBackend
    from engine.core import EngineCore
    from engine.layers.gguf_linear import GGUFBlockLinearMethod
    from engine.layers.linear import Linear, UnquantizedLinearMethod

    assert "q4_1" in fast_core.backends.description
    linears = [m for m in fast_core.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * fast_core.model.num_layers + 1
    assert all(type(m.method) is GGUFBlockLinearMethod for m in linears)
    assert isinstance(fast_core.backends.attention, CpuAttentionBackend)
    assert fast_core.model.model.norm.ops is ops
    exact = EngineCore(EngineConfig(model=model_smollm2_dir, dtype="float32", num_kv_blocks=8))
    assert exact.backends.quantization == "none"
    assert all(
        isinstance(m.method, UnquantizedLinearMethod)
        for m in exact.model.modules()
        if isinstance(m, Linear)
    )
    assert isinstance(exact.backends.attention, PagedAttentionBackend)
    assert exact.model.model.norm.ops is not ops


def test_packed_weights_are_the_files_weights(model_smollm2_dir: str) -> None:
    """Dequantizing the packed blocks gives back the exact mode's float32 weights bit for
    bit (this also proves the Q/K row order is undone correctly)."""
    from engine.layers.gguf_linear import GGUFBlockLinearMethod, GGUFSource
    from engine.model_loader import load_model
    from engine.model_resolver import gguf_source

    model, _ = load_model(model_smollm2_dir, torch.float32, torch.device("cpu"))
    method = GGUFBlockLinearMethod(GGUFSource(gguf_source(model_smollm2_dir)))
    layer = model.model.layers[3]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj, model.lm_head):
        packed = method.pack(linear)
        assert packed is not None and packed.kind == ("q8_0" if linear is model.lm_head else "q4_1")
        # x = identity rows: linear(I, W) = W^T exactly (one product per output, no sums).
        got = ops.linear(torch.eye(linear.in_features), packed).T
        assert torch.equal(got, linear.weight.detach())


def test_the_token_table_is_gathered_from_the_files_q8_0_rows(fast_core, model_smollm2_dir) -> None:
    """The fast path embeds from the GGUF's own Q8_0 token table (34 bytes a 32-value
    block, 3.8x fewer than float32), the tied LM head holds its packed copy alone, and a
    gathered row is the exact mode's float32 row bit for bit."""
    from engine.core import EngineCore

    table = fast_core.model.model.embed_tokens.weight
    assert table.dtype == torch.uint8 and table.shape[1] == 576 // 32 * 34
    assert fast_core.model.lm_head.weight.numel() == 0
    assert "token table as its Q8_0 rows" in fast_core.backends.description
    exact = EngineCore(EngineConfig(model=model_smollm2_dir, dtype="float32", num_kv_blocks=8))
    ids = torch.tensor([0, 1, 504, 3200, 49151])
    dense = exact.model.model.embed_tokens.weight.detach()
    assert torch.equal(fast_core.model.model.embed_tokens(ids), dense[ids])


def test_outputs_do_not_depend_on_load(fast_core, model_smollm2_dir, prompts) -> None:
    alone = _generate(fast_core, prompts, "alone", at_once=False)
    batched = _generate(fast_core, prompts, "batched", at_once=True)
    chunked_core = _fast_core(
        model_smollm2_dir, max_num_batched_tokens=40, enable_prefix_caching=False
    )
    chunked = _generate(chunked_core, prompts, "chunked", at_once=True)
    assert alone == batched
    assert alone == chunked


def test_greedy_agrees_with_transformers(fast_core, prompts, reference) -> None:
    got = _generate(fast_core, prompts, "ref", at_once=True)
    assert_agrees_with_reference(got, reference)


def test_auto_keeps_float16_keys_and_int8_values_and_stays_batch_invariant(
    fast_core,
    model_smollm2_dir,
    prompts,
    reference,
) -> None:
    """Where ``--quantization auto`` picks ``gguf`` (hosts without a bfloat16 kernel; here
    forced with ``--cpu-isa avx2`` where the host has one), its KV cache is float16 keys /
    int8 values (`DEFAULT_FAST_KV`: the quality bar passes, decode attention reads 0.39x
    float32's bytes), while ``gguf`` asked for by name keeps float32. Each key and value row
    is rounded from its own token's numbers alone, so the mode stays batch-invariant: alone,
    batched and prefilled in 40-token chunks give the same tokens, and they agree with
    transformers as the float32 cache does (a near-tie may flip)."""
    from engine.backends import auto_gguf_mode
    from kernels.cpu.build import select_variant

    assert (fast_core.backends.kv_dtype, fast_core.backends.v_dtype) == (torch.float32, None)
    isa = "auto" if auto_gguf_mode() == "gguf" else "avx2"
    try:
        core = _fast_core(model_smollm2_dir, quantization="auto", cpu_isa=isa)
        chunked_core = _fast_core(
            model_smollm2_dir,
            quantization="auto",
            cpu_isa=isa,
            max_num_batched_tokens=40,
            enable_prefix_caching=False,
        )
        assert (core.backends.kv_dtype, core.backends.v_dtype) == (torch.float16, torch.int8)
        assert "float16 keys / int8 values KV cache" in core.backends.description
        k_cache, v_cache = core.runner.kv_caches[0]
        assert (k_cache.dtype, v_cache.dtype) == (torch.float16, torch.int8)
        alone = _generate(core, prompts, "alone", at_once=False)
        batched = _generate(core, prompts, "batched", at_once=True)
        chunked = _generate(chunked_core, prompts, "chunked", at_once=True)
    finally:
        select_variant("auto")
    assert alone == batched
    assert alone == chunked
    assert_agrees_with_reference(batched, reference)
