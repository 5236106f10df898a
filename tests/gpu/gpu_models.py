"""Random-weight model directories made where the check runs (the GPU machine has no network
and takes no file over 64 MiB): a transformers config of a real model's shape, random
weights, and a word-level tokenizer with a chat template that covers the whole vocabulary,
so the engine, transformers and the server all load the directory like a real one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

EOS = "<|eot|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start|> {{ m['role'] }} {{ m['content'] }} <|eot|> {% endfor %}"
    "{% if add_generation_prompt %}<|start|> assistant {% endif %}"
)

# Shapes of the real models (hidden, layers, heads, kv heads, intermediate, vocab).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "arch": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
    },
    "qwen2-0.5b": {
        "arch": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
    },
    # The dry run's stand-ins: same code paths, a few MB.
    "tiny-llama": {
        "arch": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 512,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
    },
    "tiny-qwen2": {
        "arch": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "intermediate_size": 96,
        "vocab_size": 384,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
    },
}


def hf_config(name: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    rope_scaling = shape.pop("rope_scaling", None)
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = cls(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if rope_scaling is not None:
        rope = dict(rope_scaling, rope_theta=shape["rope_theta"])
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = rope
        else:
            config.rope_scaling = rope
    return config


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id (special tokens at 0..3); words carry
    SentencePiece's "▁" space marker so streamed and whole decodes give the same text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<|start|>", EOS, "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"\u2581w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(specials)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|start|>",
        "eos_token": EOS,
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def make_model_dir(name: str, root: Path, device: str, seed: int = 0) -> Path:
    """Save a random-weight ``name`` model (bf16-representable weights stored as bf16, so
    fp32 and bf16 loads on both sides see the same values) with its tokenizer."""
    from transformers import AutoModelForCausalLM

    model_dir = root / name
    if (model_dir / "config.json").is_file():
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    write_tokenizer(model_dir, config.vocab_size)
    return model_dir
