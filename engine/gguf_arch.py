"""Which GGUF architectures hearth converts, and what transformers' GGUF loader misses in them.

transformers 5.24 rebuilds the config of a llama, mistral, qwen2, qwen3, qwen3moe, gemma3
or phi3 GGUF from a fixed table of metadata keys; the rest falls back to the config
class's defaults, which are one checkpoint's values. Where llama.cpp's converter writes
what a model needs but that table skips it, `fixed_config` reads it from the file (the
keys checked against tiny models of each architecture in tests/engine/test_gguf_archs.py):

- qwen3 / qwen3moe: `head_dim` from `attention.key_length` (the class default is 128);
  qwen3moe: `moe_intermediate_size` from `expert_feed_forward_length`;
- gemma3: `query_pre_attn_scalar` (not in the file: llama.cpp scales by
  `1/sqrt(key_length)`, by `1/sqrt(hidden/heads)` for the 62-layer 27B, and so does this),
  `final_logit_softcapping`, the global layers' linear rope scaling;
- phi3: the rotary width (`rope.dimension_count` → `partial_rotary_factor`), the
  sliding window (0 means none), `original_max_position_embeddings`, and LongRoPE's
  factors, which llama.cpp stores as the tensors `rope_factors_long/short`;
- llama, mistral, qwen2, qwen3, qwen3moe: linear rope scaling (`rope.scaling.type` and
  `.factor`); q/k/v and MLP biases by their tensors;
- llama, mistral: Llama 3.x's `llama3` rope scaling, which llama.cpp keeps only as the
  `rope_freqs` tensor of per-frequency divisors (`llama3_rope` finds its parameters);
- every architecture: `pad_token_id` is the file's, or none (Phi-3's class default, 32000,
  lies outside smaller vocabularies).

- llama with experts (`expert_count`): a Mixtral, which llama.cpp writes as "llama" and
  transformers would read as a dense Llama without its experts: a `MixtralConfig` of the
  same fields plus the experts' (`_mixtral_config`).

`refusal` names the files that would convert to a different model, so they are refused
with a reason instead: rope scaling other than linear (YaRN, ...: transformers drops it),
and every architecture the table lacks.
Only the conversion child imports this module (it reads gguf-py objects, never torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GGUF_ARCHITECTURES", "fixed_config", "metadata", "refusal", "unplaced_tensors"]

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM with experts
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
"""`general.architecture` values hearth converts → the `engine.models` class that serves
the result (llama.cpp writes Llama, SmolLM/SmolLM2 and Mistral checkpoints as "llama";
transformers names a "llama" file Mistral when `general.name` says so)."""

_NOT_READ = {
    "smollm3": "transformers' GGUF loader has no SmolLM3 mapping",
}
"""Architectures engine.models serves from safetensors whose GGUF transformers cannot read."""


def metadata(reader: Any) -> dict[str, Any]:
    """The scalar and string metadata of a `gguf.GGUFReader` (arrays are left out: the
    vocabulary alone has ~100k entries)."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != GGUFValueType.ARRAY:
            out[key] = field.contents()
    return out


def refusal(arch: str, meta: dict[str, Any]) -> str | None:
    """Why a GGUF of `general.architecture` `arch` is not converted, or None."""
    served = ", ".join(sorted(GGUF_ARCHITECTURES))
    if arch in _NOT_READ:
        return (
            f"GGUF architecture {arch!r} is not converted ({_NOT_READ[arch]}); serve its "
            f"safetensors directory instead (GGUF architectures served: {served})"
        )
    if arch not in GGUF_ARCHITECTURES:
        return (
            f"GGUF architecture {arch!r} is not converted; GGUF architectures served: {served} "
            "(docs/models.md lists the architectures served from safetensors directories)"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear") or (scaling == "linear" and arch == "phi3"):
        return (
            f"this {arch!r} GGUF uses {scaling!r} rope scaling, which transformers' GGUF "
            "loader drops (hearth reads linear scaling only); serve its safetensors "
            "directory instead"
        )
    return None


_READ_HERE = frozenset(
    {"rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight"}
)
"""Tensors `fixed_config` reads into the config rather than the weights."""


def _llama3_factors(
    base: float, dim: int, factor: float, low: float, high: float, original: int
) -> list[float]:
    """The per-frequency divisors llama.cpp's converter writes as `rope_freqs` for a
    `llama3` rope scaling (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors): its
    torch float32 arithmetic, step for step, in numpy float32 (Python numbers are weak
    scalars in both)."""
    import math

    import numpy as np

    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs.astype(np.float32):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32).tolist()


def llama3_rope(reader: Any, base: float, dim: int) -> dict[str, Any] | None:
    """The `llama3` rope scaling whose factors are the file's `rope_freqs` tensor (Llama
    3.1 / 3.2 GGUFs carry no other trace of it), or None when the file has none. The
    tensor holds the factors, not the parameters: they are found among the values Meta's
    checkpoints use and the powers of two (factor = the largest divisor), and must give the
    tensor to a few float32 ulps (torch's and numpy's `pow` may differ by one). ValueError
    when nothing does."""
    import numpy as np

    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    got = np.asarray(tensor.data, np.float32).reshape(-1).tolist()
    factor = max(got)
    for original in [8192] + [2**e for e in range(4, 21) if 2**e != 8192]:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (0.5, 4.0)):
            want = _llama3_factors(base, dim, factor, low, high, original)
            if len(want) == len(got) and np.allclose(want, got, rtol=1e-5, atol=0):
                return {
                    "rope_type": "llama3",
                    "rope_theta": base,
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": original,
                }
    raise ValueError(
        "its rope_freqs tensor is no llama3 rope scaling hearth can recover (factor "
        f"{factor}; low/high frequency factors and original context not found)"
    )


def unplaced_tensors(reader: Any, arch: str, parameter_names: list[str]) -> list[str]:
    """The file's tensors that no parameter of the built model takes (transformers' loader
    drops such tensors without a word, so a config field it missed would go unnoticed)."""
    import gguf

    arch_id = next(
        (k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), gguf.MODEL_ARCH.LLAMA
    )
    name_map = gguf.get_tensor_name_map(arch_id, 1 + max(
        (int(n.split(".")[2]) for n in parameter_names if n.startswith("model.layers.")), default=0
    ))  # fmt: skip
    placed: set[str] = set()
    for name in parameter_names:
        if name.endswith("experts.gate_up_proj"):  # transformers fuses a layer's experts
            layer = name.split(".")[2]
            placed |= {f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight"}
            continue
        base, suffix = name.rsplit(".", 1)
        if suffix not in ("weight", "bias"):  # e.g. experts.down_proj: no suffix
            base, suffix = name, "weight"
        if (mapped := name_map.get_name(base)) is not None:
            placed.add(f"{mapped}.{suffix}")
    return sorted(t.name for t in reader.tensors if t.name not in placed | _READ_HERE)


def _factor_tensors(reader: Any) -> dict[str, list[float]]:
    """Phi-3's LongRoPE factors, stored by llama.cpp as F32 tensors."""
    import numpy as np

    found = {}
    for tensor in reader.tensors:
        if tensor.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            found[tensor.name.split(".")[0]] = np.asarray(tensor.data, np.float32).tolist()
    return found


def fixed_config(config: Any, arch: str, meta: dict[str, Any], reader: Any) -> Any:
    """`config` (what transformers built from the file) with the fields listed in the
    module docstring read from the file; a new config object of the same class."""
    d = config.to_dict()
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    d["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    names = {t.name for t in reader.tensors}
    if arch in ("llama", "mistral", "qwen3", "qwen3moe"):  # optional biases, by tensor
        d["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch in ("llama", "mistral"):
        d["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if arch in ("qwen3", "qwen3moe") and key("attention.key_length") is not None:
        d["head_dim"] = key("attention.key_length")
    if arch == "qwen3moe":
        d["moe_intermediate_size"] = key("expert_feed_forward_length")
        d["norm_topk_prob"] = bool(key("expert_weights_norm", True))
    if arch in ("llama", "mistral"):
        heads = key("attention.head_count")
        dim = key("rope.dimension_count") or key("embedding_length") // heads
        base = float(key("rope.freq_base", 10000.0))
        if (rope := llama3_rope(reader, base, dim)) is not None:
            d["rope_parameters"] = rope
    if key("rope.scaling.type") == "linear" and arch not in ("gemma3", "phi3"):
        rope = {**(d.get("rope_parameters") or {}), "rope_type": "linear"}
        d["rope_parameters"] = {**rope, "factor": float(key("rope.scaling.factor"))}
    if arch == "gemma3":
        heads, hidden = key("attention.head_count"), key("embedding_length")
        d["query_pre_attn_scalar"] = (
            hidden // heads if key("block_count") == 62 else key("attention.key_length")
        )
        d["final_logit_softcapping"] = key("final_logit_softcapping")
        rope = dict(d.get("rope_parameters") or {})
        scaling = key("rope.scaling.type")
        if scaling == "linear":
            full = {**rope.get("full_attention", {}), "rope_type": "linear"}
            rope["full_attention"] = {**full, "factor": float(key("rope.scaling.factor"))}
        if key("rope.freq_base_swa") is not None:
            sliding = rope.get("sliding_attention", {})
            rope["sliding_attention"] = {**sliding, "rope_theta": key("rope.freq_base_swa")}
        d["rope_parameters"] = rope
    if arch == "phi3":
        head_dim = key("embedding_length") // key("attention.head_count")
        rope = dict(d.get("rope_parameters") or {})
        rotary = key("rope.dimension_count", head_dim) / head_dim
        d["partial_rotary_factor"] = rope["partial_rotary_factor"] = rotary
        d["sliding_window"] = key("attention.sliding_window") or None
        original = key("rope.scaling.original_context_length", key("context_length"))
        d["original_max_position_embeddings"] = original
        if factors := _factor_tensors(reader):
            rope.update(
                rope_type="longrope",
                long_factor=factors["rope_factors_long"],
                short_factor=factors["rope_factors_short"],
                original_max_position_embeddings=original,
            )
        d["rope_parameters"] = rope
    if arch == "llama" and key("expert_count"):
        return _mixtral_config(d, meta, names)
    return type(config).from_dict(d)


def _mixtral_config(d: dict[str, Any], meta: dict[str, Any], names: set[str]) -> Any:
    """A "llama" file with experts is a Mixtral (llama.cpp writes Mixtral so; transformers
    reads it as a dense Llama and drops the experts): the Llama config's fields plus the
    experts' (`expert_count`, `expert_used_count`). Mixtral has no attention or MLP biases
    and its experts are one stacked tensor per projection (llama.cpp's layout since
    2024; the per-expert tensors of older files are refused by name as unplaced)."""
    from transformers import MixtralConfig

    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("a 'llama' GGUF with experts and biases is no Mixtral hearth serves")
    if not any(name.endswith("ffn_gate_exps.weight") for name in names):
        raise ValueError(
            "its experts are not stacked per projection (ffn_gate_exps): a GGUF written by "
            "llama.cpp before 2024; convert the checkpoint again with a current llama.cpp"
        )
    fields = set(MixtralConfig().to_dict()) - {
        "model_type",
        "transformers_version",
        "architectures",
    }
    mixtral = {k: v for k, v in d.items() if k in fields}
    mixtral["num_local_experts"] = int(meta["llama.expert_count"])
    mixtral["num_experts_per_tok"] = int(meta.get("llama.expert_used_count", 2))
    return MixtralConfig(**mixtral)
