"""Write a saved Hugging Face checkpoint as a GGUF file, the way llama.cpp's converter does.

The GGUF tests need files of each architecture without a download and without llama.cpp:
this reads a `save_pretrained` directory (config.json + model.safetensors) and writes it
with gguf-py's `GGUFWriter`, under the tensor names of `gguf.get_tensor_name_map`, with the
transformations and metadata keys of llama.cpp's `convert_hf_to_gguf.py` for that
architecture (Q/K rows permuted for the Llama family, Gemma's norms stored as `1 + w`,
experts stacked into `ffn_*_exps`, Phi-3's rotary width and LongRoPE factor tensors), plus
a byte-level BPE vocabulary of exactly `vocab_size` tokens. Tensors are F32, or for the 2-D
weights any type gguf-py quantizes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16), the K-quants
of `tools/kquants.py`, or llama.cpp's Q4_K_M mix (Q6_K for the head and some attn_v /
ffn_down, its fallbacks for rows that are not whole 256-column super-blocks), as llama.cpp
keeps norms and other 1-D tensors in F32.

What it does not do: real tokenizers (the tests compare token ids, not text), and
metadata llama.cpp writes only for models no test builds here (YaRN, MLA, vision).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from tools.kquants import quantize, tensor_type

__all__ = ["GGUF_ARCH", "write_gguf"]

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp writes Mistral (and Mixtral) checkpoints as "llama"
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "smollm3": "smollm3",
}
"""transformers `model_type` → the `general.architecture` llama.cpp writes for it."""

_PERMUTED = {"llama", "mistral", "mixtral", "smollm3"}
"""model types whose Q/K rows llama.cpp permutes (its `LlamaModel.permute`)."""
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rotary halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of `size` tokens: the 256 byte symbols, two-letter
    merges, and `<|endoftext|>` (a control token) last."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if size < 258:
        raise ValueError(f"a byte-level vocabulary needs at least 258 tokens, not {size}")
    tokens = list(bytes_to_unicode().values())
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [a + b for a in letters for b in letters][: size - 257]
    tokens += [*pairs, "<|endoftext|>"]
    merges = [f"{p[0]} {p[1]}" for p in pairs]
    return tokens, merges, [1] * (size - 1) + [3]


def _metadata(w: Any, cfg: dict[str, Any], arch: str) -> None:
    """The keys llama.cpp's `TextModel.set_gguf_parameters` and the architecture's own
    override write."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg.get("head_dim") is not None and arch != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if (experts := cfg.get("num_local_experts") or cfg.get("num_experts")) is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    rope_type = full.get("rope_type") or "default"
    if rope_type == "linear":  # llama.cpp's TextModel writes linear scaling for every arch
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif rope_type not in ("default", "longrope", "llama3"):  # llama3: `rope_freqs` (below)
        raise ValueError(f"rope type {rope_type!r} is not written by this helper")
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        rot = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(int(rot * hidden) // heads)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        orig = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        if rope.get("rope_type") == "longrope":
            import math

            scale = cfg["max_position_embeddings"] / orig
            attn = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
            w.add_rope_scaling_attn_factors(attn)


def _llama3_rope_freqs(cfg: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's `LlamaModel.generate_extra_tensors`, line for line: Llama 3.x's rope
    scaling as per-frequency divisors (the only trace of it the file keeps)."""
    import math

    import torch

    base = rope.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32") -> Path:
    """Write the checkpoint saved in `hf_dir` to `out` as llama.cpp would convert it, with
    its 2-D weights in `qtype` ("F32", a GGML type gguf-py or `tools/kquants.py`
    quantizes: "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
    "Q6_K", or llama.cpp's "Q4_K_M" mix); returns `out`."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    n_blocks = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_blocks
    )
    quant = None if qtype == "F32" else gguf.GGMLQuantizationType[qtype.removesuffix("_M")]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")

    out_tensors: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, data in tensors.items():
        data = data.astype(np.float32)
        if m := _EXPERT.fullmatch(name):  # stacked per layer and projection, as llama.cpp does
            layer, block, index, proj = m.groups()
            experts.setdefault((int(layer), f"model.layers.{layer}.{block}.experts.{proj}"), {})[
                int(index)
            ] = data
            continue
        if model_type in _PERMUTED and ".self_attn.q_proj." in name:  # weight and bias
            data = _permute(data, heads)
        elif model_type in _PERMUTED and ".self_attn.k_proj." in name:
            data = _permute(data, kv_heads or heads)
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            data = data + 1.0
        base, suffix = name.rsplit(".", 1)
        mapped = names.get_name(base)
        if mapped is None:
            raise ValueError(f"no GGUF name for {name} ({arch})")
        out_tensors[f"{mapped}.{suffix}"] = data
    for (_, base), by_index in sorted(experts.items()):
        mapped = names.get_name(base)
        if mapped is None:
            raise ValueError(f"no GGUF name for {base} ({arch})")
        out_tensors[f"{mapped}.weight"] = np.stack([by_index[i] for i in sorted(by_index)])

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{model_type}")
    file_type = "ALL_F32" if quant is None else f"MOSTLY_{qtype}"
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type, gguf.LlamaFileType.GUESSED))
    _metadata(writer, cfg, arch)
    tokens, merges, types = _vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    rope = cfg.get("rope_parameters") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg, rope))
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    for name, data in out_tensors.items():
        kind = tensor_type(qtype, name, data.shape, n_blocks) if quant is not None else None
        if kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
