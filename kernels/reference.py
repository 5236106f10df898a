"""Pure-torch implementations of every kernel op: the CPU production path and the test oracle.

These functions run the whole model on CPU, so they are written for speed as much as for
clarity: no Python loop over sequences or tokens, one ``scaled_dot_product_attention`` call
for all decodes of a step and one for all prefill chunks, and every tensor derived from the
step's ``AttentionMetadata`` (gather indices, masks) built once, as the step's typed plan
(``kernels.reference_plan``), for the other layers. ``tools/bench_reference.py`` holds
the alternative formulations that were measured against these; see its docstring for the
numbers.

Numerics follow Hugging Face transformers' Llama code operation for operation (same dtype
casts in the same places), so a float32 model reproduces transformers bit for bit and greedy
decoding stays token-identical.

This module must not import triton: it is what runs when triton is absent.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata
from kernels.reference_plan import DecodePlan, PrefillPlan, reference_plan

__all__ = [
    "build_cos_sin_cache",
    "compute_inv_freq",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]


# ----------------------------------------------------------------------------- embedding


def embedding(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    blocks: str = "q8_0",
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of the token embedding table (``F.embedding``), times `scale` when given
    (Gemma's ``sqrt(hidden)``, a 0-d tensor of the model dtype). `blocks` names the format
    of a table of GGUF rows, which only the CPU fast path's gather reads
    (kernels/cpu/ops.py); here the table is a float one."""
    out = F.embedding(input_ids, weight)  # [T, H]
    return out if scale is None else out * scale


# ----------------------------------------------------------------------------- norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as transformers' ``LlamaRMSNorm``.

    The statistics are taken in float32 and the normalised value is cast back to the input
    dtype *before* the weight multiply; doing the multiply in float32 instead would change
    bf16 results in the last bit and break token-identity with transformers.
    """
    # x: [num_tokens, hidden]; weight: [hidden]
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)  # [num_tokens, 1]
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (in the input dtype, as the model's residual stream
    is), then ``rms_norm(new_residual)``. Returns ``(normed, new_residual)``; inputs are not
    modified."""
    new_residual = x + residual  # [num_tokens, hidden]
    return rms_norm(new_residual, weight, eps), new_residual


# ----------------------------------------------------------------------------- rotary


def compute_inv_freq(
    head_dim: int, base: float, rope_scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` float32 on CPU, computed with the very
    same float32 operations as transformers (default rope, ``linear``, ``llama3`` and ``yarn``), which
    is what keeps our angles bit-identical to theirs."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]  # type: ignore[index]
    if rope_type == "llama3":
        assert rope_scaling is not None
        # transformers.modeling_rope_utils._compute_llama3_parameters, line for line.
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + (
            smooth_factor * inv_freq_llama
        )
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    if rope_type == "yarn":
        assert rope_scaling is not None
        return _yarn_parameters(head_dim, base, rope_scaling)[0]
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


def _yarn_parameters(
    head_dim: int, base: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN's (inverse frequencies, attention factor): transformers'
    ``_compute_yarn_parameters`` line for line, in float32 (gpt-oss; DeepSeek's
    ``mscale`` / ``mscale_all_dim``). `scaling` carries ``factor`` and
    ``original_max_position_embeddings`` (``factor`` None: ``max_position_embeddings``
    over it, which the caller folds in as ``factor``); ``beta_fast`` / ``beta_slow``
    default to 32 / 1, ``truncate`` to True."""
    dim = head_dim
    factor = scaling["factor"]
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    original = scaling["original_max_position_embeddings"]

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    rope_scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``[max_position, head_dim]``: row p is ``cat(cos(p * inv_freq), sin(p * inv_freq))``.

    Built the way ``LlamaRotaryEmbedding.forward`` builds cos/sin: inv_freq on CPU, angles
    ``positions.float() * inv_freq`` in float32 on the target device, cos/sin of the
    duplicated angle vector (same tensor layout, hence the same vectorised math path), then
    cast to ``dtype``. ``head_dim`` is the rotary width (smaller than the head under a
    partial rotary factor).

    YaRN (gpt-oss, ``rope_type`` ``yarn``): the blended inverse frequencies, cos and sin
    multiplied by the attention factor, as transformers' rotary does.

    LongRoPE (Phi-3/4, ``rope_type`` ``longrope``): rows below
    ``original_max_position_embeddings`` use the short factors, the rows from there on the
    long ones, both scaled by the attention factor; row p is what transformers' rotary
    gives for position p alone. A sequence that stays below the original length is
    therefore exact. transformers re-encodes a sequence that grows past it with the long
    factors throughout (its `generate` drops the cache); a paged cache keeps the keys it
    has, so beyond that length the two differ (as vLLM's cache does too).
    """
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "longrope":
        assert rope_scaling is not None
        return _longrope_cos_sin_cache(head_dim, max_position, base, dtype, device, rope_scaling)
    if rope_type == "yarn":  # cos and sin are scaled by YaRN's attention factor (mscale)
        assert rope_scaling is not None
        inv_freq, attention_factor = _yarn_parameters(head_dim, base, rope_scaling)
        return _cos_sin(inv_freq, 0, max_position, dtype, device, attention_factor)
    inv_freq = compute_inv_freq(head_dim, base, rope_scaling)  # [head_dim // 2]
    return _cos_sin(inv_freq, 0, max_position, dtype, device)


def _cos_sin(
    inv_freq: torch.Tensor,
    start: int,
    stop: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """Rows ``start .. stop - 1`` of the cos/sin table of `inv_freq` (see above)."""
    inv_freq = inv_freq.to(device)
    positions = torch.arange(start, stop, device=device, dtype=torch.int64)
    freqs = positions[:, None].float() * inv_freq  # [rows, rot_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [rows, rot_dim]
    half = inv_freq.shape[0]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:  # transformers multiplies even by 1.0, which is exact
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1).to(dtype).contiguous()


def _longrope_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    dtype: torch.dtype,
    device: torch.device | str | None,
    scaling: dict[str, Any],
) -> torch.Tensor:
    """transformers' ``_compute_longrope_parameters``, both factor sets, one table."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim

    def inv_freq(ext: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**shape)

    short = _cos_sin(
        inv_freq(scaling["short_factor"]), 0, min(original, max_position), dtype, device,
        attention_factor,
    )  # fmt: skip
    if max_position <= original:
        return short
    long = _cos_sin(
        inv_freq(scaling["long_factor"]), original, max_position, dtype, device, attention_factor
    )
    return torch.cat((short, long), dim=0).contiguous()


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-NeoX / HF-Llama ``rotate_half`` rotary; returns new ``(query, key)``.

    ``x * cos + rotate_half(x) * sin`` with cos/sin cast to x's dtype first, as
    ``apply_rotary_pos_emb`` does. Written per half (``x1*c - x2*s``, ``x2*c + x1*s``),
    which is bitwise the same float arithmetic without building ``rotate_half(x)`` and the
    duplicated cos/sin. A cache narrower than head_dim rotates only the leading dims.
    """
    # positions: [T]; query: [T, num_heads, head_dim]; key: [T, num_kv_heads, head_dim]
    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    cs = cos_sin_cache.index_select(0, positions.long())  # [T, rot_dim]
    return _rotate(query, cs, half), _rotate(key, cs, half)


def _rotate(x: torch.Tensor, cs: torch.Tensor, half: int) -> torch.Tensor:
    # x: [T, heads, head_dim]; cs: [T, 2 * half]
    cos = cs[:, None, :half].to(x.dtype)  # [T, 1, half]
    sin = cs[:, None, half:].to(x.dtype)
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half : 2 * half])
    if 2 * half < x.shape[-1]:
        out[..., 2 * half :] = x[..., 2 * half :]
    return out


# ----------------------------------------------------------------------------- activation


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the fused gate/up projection output ``[T, 2 * I]``.

    transformers applies silu to a contiguous ``gate_proj`` output. torch's vectorised exp
    and its scalar tail loop differ in the last bit, and a row-strided ``gate`` view gets a
    scalar tail in every row when I is not a multiple of the vector loop; such gates are
    made contiguous first so the bits stay identical (real widths skip the copy).
    """
    d = x.shape[-1] // 2
    gate = x[..., :d]
    if d % 64 != 0:
        gate = gate.contiguous()
    return F.silu(gate) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of a fused gate/up output ``[T, 2 * I]``
    (Gemma's GeGLU, transformers' ``gelu_pytorch_tanh``); the gate is made contiguous
    under the same rule as `silu_and_mul`, for the same last-bit reason."""
    d = x.shape[-1] // 2
    gate = x[..., :d]
    if d % 64 != 0:
        gate = gate.contiguous()
    return F.gelu(gate, approximate="tanh") * x[..., d:]


# ----------------------------------------------------------------------------- KV cache


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the step's new K/V into their cache slots in place; slots < 0 are padding."""
    # key/value: [T, num_kv_heads, head_dim]; caches: [num_blocks, block_size, nkv, head_dim]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # view: raises if not contiguous
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    n = slots.shape[0]
    key, value = key[:n], value[:n]
    if n and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


KV_INT8_SCALE_BYTES = 4
"""An int8 KV cache row's float32 scale, stored after its head_dim int8 values."""


def kv_head_elems(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (slot, kv head) row of a KV cache of ``dtype``: the caches' last
    dimension (head_dim, plus the scale's 4 bytes for int8)."""
    return head_dim + KV_INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv_int8(x: torch.Tensor) -> torch.Tensor:
    """int8 cache rows of float32 ``x [..., head_dim]``: ``[..., head_dim + 4]`` int8, each row
    q = round(x * 127 / amax) (nearest-even; amax = max |x| of the row after clamping to
    +-65504, the float16 path's range) followed by the float32 bytes of amax / 127. Why per
    row: a token's error stays its own (batch invariance), and one outlier row cannot
    coarsen the others. The C kernels (`kernels.cpu.ops.write_kv_cache`) store the same."""
    x = x.float().clamp(-65504.0, 65504.0)
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-127, 127).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # [..., 4]: the float32's bytes
    return torch.cat([q, scale], dim=-1)


def dequantize_kv_int8(rows: torch.Tensor) -> torch.Tensor:
    """The float32 values int8 cache rows stand for: q * scale."""
    q, scale = rows[..., :-KV_INT8_SCALE_BYTES], rows[..., -KV_INT8_SCALE_BYTES:]
    return q.float() * scale.contiguous().view(torch.float32)


# ----------------------------------------------------------------------------- attention


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a mixed decode + prefill step over the paged cache (see ``AttentionMetadata``).

    ``sliding_window`` (None: global): a query at position p sees keys p - W + 1 .. p
    only, by the masks of the step's plan for that window.

    ``sinks`` (None: none): gpt-oss's learned per-head attention sinks ``[num_heads]``,
    one extra logit per head that joins the softmax denominator and attends to nothing
    (its probability is dropped), so each row's weights sum to less than one. SDPA has
    no such term, so with sinks each row gets one more key, zeros, masked by the sink
    (`_sink_attention`).

    Decodes: every sequence's blocks are gathered at once with one ``index_select`` over the
    cache's block axis (``[num_decodes, blocks * block_size, nkv, hd]``, the tail past each
    seq_len masked), and one SDPA call does all of them; GQA never copies K/V (float32: a
    KV group's query heads become the query rows of their kv head, ``[B, nkv, group, hd]``;
    16-bit: SDPA's ``enable_gqa``, whichever measured faster).
    Prefill chunks: padded to ``[num_prefills, max_query_len]`` and done in one SDPA call with
    a causal-with-offset mask; a lone chunk without a cached prefix uses ``is_causal``.
    The indices and masks come from the step's plan (``kernels.reference_plan``), built by
    the first layer.

    Whole blocks are read, so slots past a sequence's length and block-table padding
    (block 0) go through the masked math: they must hold finite numbers. Allocate the cache
    with ``torch.zeros`` (stale K/V of freed sequences is fine; ``torch.empty`` garbage may
    be NaN/inf and would poison the rows). The Triton kernels never read those slots.
    """
    # query: [num_tokens, num_heads, head_dim]
    num_tokens = query.shape[0]
    nd = meta.num_decode_tokens
    plan = reference_plan(meta, k_cache.shape[1], query.dtype, sliding_window)
    parts: list[torch.Tensor] = []
    if plan.decode is not None:
        parts.append(_decode_attention(query[:nd], k_cache, v_cache, plan.decode, scale, sinks))
    if plan.prefill is not None:
        q_prefill = query[nd : nd + plan.prefill.num_tokens]
        parts.append(
            _prefill_attention(q_prefill, k_cache, v_cache, plan.prefill, meta, scale, sinks)
        )
    covered = sum(p.shape[0] for p in parts)
    if covered < num_tokens:  # trailing padding tokens (none today): defined zeros
        parts.append(query.new_zeros((num_tokens - covered, *query.shape[1:])))
    if len(parts) == 1:
        return parts[0]
    if not parts:  # an empty step
        return query.new_zeros(query.shape)
    return torch.cat(parts, dim=0)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``[num_seqs, nkv, blocks * block_size, hd]`` (a strided view of one contiguous copy).

    Gathering whole blocks copies ``block_size * nkv * hd`` contiguous elements per index,
    which measured as fast as a per-slot gather while needing 16x fewer indices.
    """
    # cache: [num_blocks, block_size, nkv, hd]; block_ids: [num_seqs * blocks] int64
    nkv, hd = cache.shape[2:]
    g = cache.index_select(0, block_ids)  # [num_seqs * blocks, block_size, nkv, hd]
    return g.view(num_seqs, -1, nkv, hd).transpose(1, 2)


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # query: [B, num_heads, hd] (one token per decoding sequence)
    b, num_heads, hd = query.shape
    nkv = k_cache.shape[2]
    k = _gather_blocks(k_cache, plan.block_ids, b)  # [B, nkv, L, hd]
    v = _gather_blocks(v_cache, plan.block_ids, b)
    if sinks is not None:
        out = _sink_attention(query[:, :, None], k, v, plan.mask, scale, sinks)
    elif query.dtype == torch.float32:
        # Head h uses kv head h // group, so a group's heads are contiguous: [B, nkv, group,
        # hd] is a free view, and the group's heads become the query rows of their kv head.
        # Measured fastest in float32 (see bench_reference.py).
        q = query.view(b, nkv, num_heads // nkv, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
    else:
        # In bf16/fp16 the CPU kernel's own GQA path measured ~10% faster than the above.
        q = query[:, :, None]  # [B, num_heads, 1, hd]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.mask, scale=scale, enable_gqa=nkv != num_heads
        )
    return out.reshape(b, num_heads, hd)


def _prefill_attention(
    q_all: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # q_all: the prefill part of the step [n, num_heads, hd]; returns its output.
    n, num_heads, hd = q_all.shape
    nkv = k_cache.shape[2]
    p = meta.num_prefills
    k = _gather_blocks(k_cache, plan.block_ids, p)  # [P, nkv, L, hd]
    v = _gather_blocks(v_cache, plan.block_ids, p)
    if plan.causal_only:
        q = q_all.view(1, n, num_heads, hd).transpose(1, 2)  # [1, num_heads, n, hd]
        if sinks is not None:
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
            mask = torch.zeros(n, n, dtype=q.dtype, device=q.device).masked_fill_(
                ~causal, float("-inf")
            )  # [n, n] additive
            out = _sink_attention(q, k[:, :, :n], v[:, :, :n], mask, scale, sinks)
        else:
            out = F.scaled_dot_product_attention(
                q, k[:, :, :n], v[:, :, :n], is_causal=True, scale=scale,
                enable_gqa=nkv != num_heads,
            )  # fmt: skip
        # [1, num_heads, n, hd]
        return out.transpose(1, 2).reshape(n, num_heads, hd)
    assert plan.tok_idx is not None and plan.out_idx is not None
    max_q = meta.prefill_max_query_len
    single = p == 1 and max_q == n  # one chunk (after a cached prefix): no padding needed
    q = q_all if single else q_all.index_select(0, plan.tok_idx)  # [P * max_q, heads, hd]
    q = q.view(p, max_q, num_heads, hd).transpose(1, 2)
    if sinks is not None:
        out = _sink_attention(q, k, v, plan.mask, scale, sinks)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.mask, scale=scale, enable_gqa=nkv != num_heads
        )  # [P, num_heads, max_q, hd]
    out = out.transpose(1, 2).reshape(p * max_q, num_heads, hd)
    return out if single else out.index_select(0, plan.out_idx)


def _sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention with a per-head sink logit (gpt-oss) as ONE SDPA call: the sink is one
    more key, of zeros, whose additive mask value is the head's sink, so its score is
    exactly ``sinks[h]`` and its value (zeros) adds nothing to the output; its weight
    only joins the denominator, as in transformers' ``eager_attention_forward``.

    PERF: the explicit eager formulation (matmul, cat, max, softmax, matmul) measured
    ~0.25 ms per decode layer on one thread and up to 35 ms on the busy 2-core test
    host (an OpenMP barrier per op); this one 0.07 ms and 0.23 ms.

    q: [B, H, Lq, hd]; k, v: [B, nkv, L, hd]; mask: additive, broadcastable to
    [B, H, Lq, L]; sinks: [H]. Returns [B, H, Lq, hd]. The sink column is finite, so a
    row whose keys are all masked gives zeros, never NaN.
    """
    b, num_heads, lq, _ = q.shape
    k = F.pad(k, (0, 0, 0, 1))  # [B, nkv, L + 1, hd]: the sink's zero key and value
    v = F.pad(v, (0, 0, 0, 1))
    length = k.shape[2] - 1
    sink = sinks.to(q.dtype).view(1, num_heads, 1, 1).expand(b, num_heads, lq, 1)
    mask = torch.cat([mask.expand(b, num_heads, lq, length), sink], dim=-1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != num_heads
    )
