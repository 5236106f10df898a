"""The torch reference (the CPU production path) against independent oracles.

Norm, rotary and activation are compared with transformers' own Llama code, bit for bit:
that is what keeps greedy decoding token-identical to transformers. Paged attention is
compared with dense causal attention computed per sequence and head in float64 without
any paging (``tests.kernels.cases.naive_attention``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from kernels import reference
from tests.kernels.cases import make_step, naive_attention, scatter_dense_kv

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# ------------------------------------------------------------------------- rms norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_bitwise_matches_transformers(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(0)
    hf = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden) * 0.5 + 1)
    x = (torch.randn(7, hidden) * 3).to(dtype)
    with torch.no_grad():
        expected = hf(x)
    got = reference.rms_norm(x, hf.weight.detach(), 1e-5)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(5, 64).to(dtype)
    residual = torch.randn(5, 64).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    normed, new_residual = reference.fused_add_rms_norm(x, residual, hf.weight.detach(), 1e-6)
    with torch.no_grad():
        assert torch.equal(new_residual, residual + x)  # the decoder layer's `residual + h`
        assert torch.equal(normed, hf(residual + x))
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must not be modified"


# ------------------------------------------------------------------------- rotary


def _hf_rotary(head_dim: int, theta: float, rope_scaling: dict | None) -> LlamaRotaryEmbedding:
    params = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        params = {**rope_scaling, "rope_theta": theta}
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters=params,
    )
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize(
    ("theta", "rope_scaling"),
    [
        (100000.0, None),
        (10000.0, None),
        (500000.0, LLAMA3),
        (10000.0, {"rope_type": "linear", "factor": 4.0}),
    ],
    ids=["smollm2", "llama2", "llama3", "linear"],
)
def test_inv_freq_bitwise_matches_transformers(theta: float, rope_scaling: dict | None) -> None:
    hf = _hf_rotary(64, theta, rope_scaling)
    assert torch.equal(reference.compute_inv_freq(64, theta, rope_scaling), hf.inv_freq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("theta", "rope_scaling"), [(100000.0, None), (500000.0, LLAMA3)], ids=["default", "llama3"]
)
def test_cos_sin_cache_matches_transformers(
    dtype: torch.dtype, theta: float, rope_scaling: dict | None
) -> None:
    head_dim, max_pos = 64, 2048
    hf = _hf_rotary(head_dim, theta, rope_scaling)
    x = torch.zeros(1, dtype=dtype)
    cos, sin = hf(x, torch.arange(max_pos)[None])  # [1, max_pos, head_dim]
    cache = reference.build_cos_sin_cache(head_dim, max_pos, theta, dtype, "cpu", rope_scaling)
    assert cache.shape == (max_pos, head_dim) and cache.dtype == dtype
    assert torch.equal(cache[:, : head_dim // 2], cos[0, :, : head_dim // 2])
    assert torch.equal(cache[:, head_dim // 2 :], sin[0, :, : head_dim // 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rotary_embedding_bitwise_matches_transformers(
    dtype: torch.dtype, rope_scaling: dict | None
) -> None:
    torch.manual_seed(2)
    head_dim, num_heads, num_kv, theta = 64, 9, 3, 100000.0
    hf = _hf_rotary(head_dim, theta, rope_scaling)
    positions = torch.tensor([0, 1, 2, 17, 300, 1999, 5, 1023])
    t = positions.shape[0]
    q = torch.randn(t, num_heads, head_dim).to(dtype)
    k = torch.randn(t, num_kv, head_dim).to(dtype)
    cos, sin = hf(q, positions[None])  # [1, T, head_dim] in q's dtype
    # transformers' layout is [batch, heads, T, head_dim]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = reference.build_cos_sin_cache(head_dim, 2048, theta, dtype, "cpu", rope_scaling)
    q_out, k_out = reference.rotary_embedding(positions, q, k, cache)
    assert torch.equal(q_out, q_hf[0].transpose(0, 1))
    assert torch.equal(k_out, k_hf[0].transpose(0, 1))


def test_rotary_accepts_strided_views_and_float32_cache() -> None:
    """The model slices q and k out of one fused QKV output; a float32 cache with bf16
    activations is cast to bf16 first, as transformers casts cos/sin to x's dtype."""
    torch.manual_seed(3)
    t, h, kv, d = 5, 4, 2, 32
    qkv = torch.randn(t, (h + 2 * kv) * d, dtype=torch.bfloat16)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kv) * d].view(t, kv, d)
    positions = torch.tensor([3, 1, 4, 1, 5])
    cache32 = reference.build_cos_sin_cache(d, 16, 10000.0, torch.float32)
    q1, k1 = reference.rotary_embedding(positions, q, k, cache32)
    q2, k2 = reference.rotary_embedding(
        positions, q.contiguous(), k.contiguous(), cache32.to(torch.bfloat16)
    )
    assert q1.dtype == torch.bfloat16
    assert torch.equal(q1, q2) and torch.equal(k1, k2)


def test_partial_rotary_leaves_tail_dims() -> None:
    torch.manual_seed(4)
    q = torch.randn(3, 2, 64)
    k = torch.randn(3, 1, 64)
    pos = torch.tensor([0, 7, 9])
    cache = reference.build_cos_sin_cache(32, 16, 10000.0, torch.float32)
    q_out, _ = reference.rotary_embedding(pos, q, k, cache)
    assert torch.equal(q_out[..., 32:], q[..., 32:])
    full, _ = reference.rotary_embedding(pos, q[..., :32].contiguous(), k[..., :32], cache)
    assert torch.equal(q_out[..., :32], full)


def test_position_zero_is_identity() -> None:
    q = torch.randn(1, 3, 16)
    k = torch.randn(1, 1, 16)
    cache = reference.build_cos_sin_cache(16, 4, 10000.0, torch.float32)
    q_out, k_out = reference.rotary_embedding(torch.tensor([0]), q, k, cache)
    assert torch.equal(q_out, q) and torch.equal(k_out, k)


# ------------------------------------------------------------------------- activation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [40, 1536])
def test_silu_and_mul_matches_transformers_mlp(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(5)
    gate = torch.randn(6, width).to(dtype)
    up = torch.randn(6, width).to(dtype)
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    assert torch.equal(reference.silu_and_mul(torch.cat([gate, up], dim=-1)), expected)


# ------------------------------------------------------------------------- kv cache


def test_write_kv_cache_places_tokens_and_skips_padding() -> None:
    torch.manual_seed(6)
    nb, bs, kv, d = 6, 4, 2, 8
    k_cache = torch.zeros(nb, bs, kv, d)
    v_cache = torch.zeros(nb, bs, kv, d)
    key = torch.randn(5, kv, d)
    value = torch.randn(5, kv, d)
    slots = torch.tensor([9, -1, 0, 23, 14])
    reference.write_kv_cache(key, value, k_cache, v_cache, slots)
    k_flat, v_flat = k_cache.view(-1, kv, d), v_cache.view(-1, kv, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_flat[s], key[t]) and torch.equal(v_flat[s], value[t])
    written = {s for s in slots.tolist() if s >= 0}
    for s in range(nb * bs):
        if s not in written:
            assert not k_flat[s].any() and not v_flat[s].any()


def test_write_kv_cache_strided_key_from_fused_qkv() -> None:
    kv, d = 2, 8
    qkv = torch.randn(3, (4 + 2 * kv) * d)
    key = qkv[:, 4 * d : (4 + kv) * d].view(3, kv, d)
    value = qkv[:, (4 + kv) * d :].view(3, kv, d)
    k_cache = torch.zeros(2, 4, kv, d)
    v_cache = torch.zeros(2, 4, kv, d)
    reference.write_kv_cache(key, value, k_cache, v_cache, torch.tensor([7, 0, 3]))
    assert torch.equal(k_cache.view(-1, kv, d)[[7, 0, 3]], key)
    assert torch.equal(v_cache.view(-1, kv, d)[[7, 0, 3]], value)


# ------------------------------------------------------------------------- paged attention

# (seq_len, query_len) per sequence, decodes (query_len 1) first.
ATTENTION_CASES = {
    "decode_only": [(1, 1), (17, 1), (33, 1), (64, 1), (5, 1)],
    "single_prefill_no_prefix": [(37, 37)],
    "chunk_with_cached_prefix": [(50, 13)],
    "several_prefills": [(9, 9), (40, 23), (31, 31), (3, 2)],
    "mixed": [(12, 1), (70, 1), (3, 1), (29, 29), (45, 16), (8, 8)],
    "one_token_prefill": [(21, 1), (15, 1)],  # a chunk of length 1 on the prefill path
}


def _attention_case(
    name: str,
    num_heads: int,
    num_kv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> tuple:
    seqs = ATTENTION_CASES[name]
    gen = torch.Generator().manual_seed(seed)
    num_decodes = 1 if name == "one_token_prefill" else None
    num_blocks = sum(-(-s // block_size) for s, _ in seqs) + 7
    step = make_step(
        seqs, block_size, num_blocks, generator=gen, table_pad=2, num_decodes=num_decodes
    )
    # Unused slots hold large finite garbage so a read of a wrong slot shows.
    k_cache = torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen) * 30
    v_cache = torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen) * 30
    keys = [torch.randn(s, num_kv, head_dim, generator=gen) for s, _ in seqs]
    values = [torch.randn(s, num_kv, head_dim, generator=gen) for s, _ in seqs]
    scatter_dense_kv(step, keys, values, k_cache, v_cache)
    query = torch.randn(step.positions.shape[0], num_heads, head_dim, generator=gen)
    to = {"dtype": dtype, "device": device}
    keys = [k.to(dtype) for k in keys]
    values = [v.to(dtype) for v in values]
    return step, query.to(**to), k_cache.to(**to), v_cache.to(**to), keys, values


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv", "block_size"),
    [(9, 3, 16), (4, 4, 4), (8, 1, 5)],
    ids=["gqa3_bs16", "mha_bs4", "mqa_bs5"],
)
def test_paged_attention_matches_dense_oracle(
    case: str, num_heads: int, num_kv: int, block_size: int
) -> None:
    step, q, kc, vc, keys, values = _attention_case(
        case, num_heads, num_kv, 32, block_size, torch.float32
    )
    scale = 32**-0.5
    got = reference.paged_attention(q, kc, vc, step.meta, scale)
    expected = naive_attention(step, q, keys, values, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["decode_only", "mixed", "single_prefill_no_prefix"])
def test_paged_attention_16bit(dtype: torch.dtype, case: str) -> None:
    step, q, kc, vc, keys, values = _attention_case(case, 6, 2, 64, 16, dtype)
    got = reference.paged_attention(q, kc, vc, step.meta, 0.125)
    expected = naive_attention(step, q, keys, values, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)


def test_paged_attention_caches_plan_once_per_step() -> None:
    step, q, kc, vc, _, _ = _attention_case("mixed", 9, 3, 32, 16, torch.float32)
    assert step.meta.reference_plan is None
    first = reference.paged_attention(q, kc, vc, step.meta, 0.2)
    plan = step.meta.reference_plan
    assert plan is not None and plan.dtype == torch.float32
    assert plan.decode is not None and plan.prefill is not None
    second = reference.paged_attention(q, kc, vc, step.meta, 0.2)  # "the next layer"
    assert torch.equal(first, second)
    assert step.meta.reference_plan is plan, "plan rebuilt"


def test_paged_attention_padding_rows_never_nan() -> None:
    """Chunks of very different lengths pad the short one heavily; its real rows must be
    exact and no NaN may appear anywhere in the output."""
    gen = torch.Generator().manual_seed(7)
    seqs = [(1, 1), (2, 2), (40, 40), (41, 1 + 1)]
    step = make_step(seqs, 4, 64, generator=gen)
    kc = torch.randn(64, 4, 2, 16, generator=gen)
    vc = torch.randn(64, 4, 2, 16, generator=gen)
    q = torch.randn(step.positions.shape[0], 4, 16, generator=gen)
    out = reference.paged_attention(q, kc, vc, step.meta, 0.25)
    assert torch.isfinite(out).all()
    # Query 0 of a prefill at position 0 sees only key 0: its output is exactly v[0].
    t = 1  # the (2, 2) chunk starts right after the single decode
    blk = step.block_tables[1][0]
    torch.testing.assert_close(out[t], vc[blk, 0].repeat_interleave(2, dim=0))


@pytest.mark.parametrize("case", ["mixed", "single_prefill_no_prefix", "chunk_with_cached_prefix"])
def test_paged_attention_non_contiguous_query(case: str) -> None:
    step, q, kc, vc, _, _ = _attention_case(case, 4, 2, 32, 16, torch.float32)
    wide = torch.randn(q.shape[0], 3 * q.shape[1] * q.shape[2])
    wide[:, : q.shape[1] * q.shape[2]] = q.reshape(q.shape[0], -1)
    q_view = wide[:, : q.shape[1] * q.shape[2]].view(q.shape)
    assert not q_view.is_contiguous()
    got = reference.paged_attention(q_view, kc, vc, step.meta, 0.2)
    torch.testing.assert_close(got, reference.paged_attention(q, kc, vc, step.meta, 0.2))


def test_decode_group_formulations_agree() -> None:
    """float32 decodes use the heads-as-rows layout, 16-bit ones SDPA's enable_gqa: both
    must equal plain SDPA over repeated K/V."""
    step, q, kc, vc, keys, values = _attention_case("decode_only", 9, 3, 32, 16, torch.float32)
    got = reference.paged_attention(q, kc, vc, step.meta, 0.3)
    rows = []
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        k_rep = k.repeat_interleave(3, dim=1).transpose(0, 1)  # [H, L, hd]
        v_rep = v.repeat_interleave(3, dim=1).transpose(0, 1)
        rows.append(F.scaled_dot_product_attention(q[i][:, None], k_rep, v_rep, scale=0.3)[:, 0])
    torch.testing.assert_close(got, torch.stack(rows), atol=1e-5, rtol=1e-5)


def test_empty_step() -> None:
    step = make_step([], 4, 4)
    q = torch.randn(0, 2, 16)
    kc = torch.randn(4, 4, 1, 16)
    assert reference.paged_attention(q, kc, kc, step.meta, 0.25).shape == (0, 2, 16)


def test_scale_is_applied() -> None:
    step, q, kc, vc, keys, values = _attention_case("several_prefills", 2, 1, 16, 4, torch.float32)
    scale = 1 / math.sqrt(3.0)
    torch.testing.assert_close(
        reference.paged_attention(q, kc, vc, step.meta, scale).double(),
        naive_attention(step, q, keys, values, scale),
        atol=2e-5,
        rtol=1e-5,
    )


def _sinks(num_heads: int, seed: int = 4) -> torch.Tensor:
    """Per-head sink logits around the scores' own size (some far above, some below), so
    the extra denominator term changes every row noticeably."""
    return 3.0 * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_with_sinks_matches_dense_oracle(case: str, window: int | None) -> None:
    """gpt-oss's attention sinks on every path of the reference (decodes, a lone causal
    chunk, padded chunks, GQA), with and without a window; zeroed sinks are not a no-op
    (a sink of 0 still adds exp(0 - max) to the denominator), and sinks of -inf are plain
    attention."""
    step, q, kc, vc, keys, values = _attention_case(case, 6, 2, 32, 4, torch.float32)
    sinks = _sinks(6)
    got = reference.paged_attention(q, kc, vc, step.meta, 0.2, window, sinks)
    expected = naive_attention(step, q, keys, values, 0.2, window, sinks)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)
    plain = reference.paged_attention(q, kc, vc, step.meta, 0.2, window)
    assert (got - plain).abs().max() > 1e-2
    none = torch.full((6,), float("-inf"))
    torch.testing.assert_close(
        reference.paged_attention(q, kc, vc, step.meta, 0.2, window, none), plain,
        atol=1e-6, rtol=1e-5,
    )  # fmt: skip


def test_paged_attention_with_sinks_16bit() -> None:
    step, q, kc, vc, keys, values = _attention_case("mixed", 6, 2, 64, 16, torch.bfloat16)
    sinks = _sinks(6).to(torch.bfloat16)
    got = reference.paged_attention(q, kc, vc, step.meta, 0.125, None, sinks)
    assert got.dtype == torch.bfloat16
    expected = naive_attention(step, q, keys, values, 0.125, None, sinks)
    torch.testing.assert_close(got.double(), expected, atol=3e-2, rtol=3e-2)


YARN_CASES = {
    "gpt-oss": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096,
    },
    "truncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "deepseek-mscale": {
        "rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
    },
    "attention-factor": {
        "rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3,
        "original_max_position_embeddings": 2048,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(YARN_CASES))
def test_yarn_matches_transformers(name: str) -> None:
    """YaRN's inverse frequencies and attention factor are bitwise transformers'
    ``_compute_yarn_parameters`` (float32), and the cos/sin table equals its rotary's
    cos/sin (both scaled by the attention factor) at every position."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    theta, head_dim, max_pos = 150000.0, 64, 8192
    params = {**YARN_CASES[name], "rope_theta": theta}
    config = GptOssConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=max_pos, rope_parameters=dict(params), num_hidden_layers=1,
    )  # fmt: skip
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    assert torch.equal(reference.compute_inv_freq(head_dim, theta, scaling), hf_inv_freq)
    _, factor = reference._yarn_parameters(head_dim, theta, scaling)
    assert factor == hf_factor and (name == "attention-factor") == (factor == 1.3)
    hf = GptOssRotaryEmbedding(config)
    cos, sin = hf(torch.zeros(1), torch.arange(max_pos)[None])  # [1, max_pos, head_dim // 2]
    cache = reference.build_cos_sin_cache(head_dim, max_pos, theta, torch.float32, "cpu", scaling)
    torch.testing.assert_close(cache[:, : head_dim // 2], cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, head_dim // 2 :], sin[0], atol=1e-6, rtol=0)
    if name == "gpt-oss":  # the released parameters: measured bit for bit
        assert torch.equal(cache, torch.cat([cos[0], sin[0]], dim=-1))
    assert not torch.equal(hf_inv_freq, reference.compute_inv_freq(head_dim, theta))


def test_rope_config_reads_gpt_oss_yarn() -> None:
    """gpt-oss's default rope parameters come through `rope_config` as a YaRN dict."""
    from transformers import GptOssConfig

    from engine.layers.rotary import rope_config

    config = GptOssConfig(num_hidden_layers=1)
    theta, scaling = rope_config(config)
    assert theta == 150000.0 and scaling is not None
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 32.0
    assert scaling["original_max_position_embeddings"] == 4096 and scaling["truncate"] is False
