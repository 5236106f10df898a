"""Random PEFT LoRA adapters and their transformers + PEFT reference outputs, for the
engine, server and benchmark checks (no download: the base is a local directory).

`make_adapter` wraps the base in PEFT's `get_peft_model` with ``init_lora_weights=False``
(so B is random too and the adapter changes the output) and saves it with
`save_pretrained`: exactly the files a fine-tune leaves.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    # Different targets, ranks and scalings, so a mix in one step exercises all of them.
    "alpha": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "beta": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    },
    "gamma": {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj"],
        "layers_to_transform": [0],
    },
    "delta": {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "down_proj"]},
}


def _base(base_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return model.eval()


def make_adapter(base_dir: str, out_dir: Path, seed: int, **lora: Any) -> str:
    """A random adapter on `base_dir` saved to `out_dir` (returned as a string)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0, **lora)
    peft_model = get_peft_model(_base(base_dir), config)
    # Scale the random weights down: PEFT's kaiming init on both A and B makes the
    # delta dominate the base; a gentler adapter still changes the greedy tokens.
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.25)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def make_adapters(base_dir: str, root: Path, names: list[str] | None = None) -> dict[str, str]:
    names = names or list(ADAPTER_SPECS)
    return {
        name: make_adapter(base_dir, root / name, seed=i + 1, **ADAPTER_SPECS[name])
        for i, name in enumerate(names)
    }


def reference_tokens(
    base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations by transformers (+ PEFT when `adapter_dir` is given), float32,
    always `max_new_tokens` long (EOS ignored, as the engine's requests ask)."""
    model = _base(base_dir)
    model.generation_config.eos_token_id = None
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return greedy_continuations(model, prompts, max_new_tokens, pad_token_id=0)


def greedy_continuations(
    model: Any, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int
) -> list[list[int]]:
    """transformers' greedy `generate` on each prompt alone (stopping where the model's
    generation config says): the new tokens only."""
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_token_id,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def tiny_llama(out_dir: Path, tokenizer_dir: str) -> str:
    """A 2-layer random Llama with the default model's tokenizer (so the server and
    the engine can load it like any model directory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(str(out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, out_dir / name)
    return str(out_dir)


def write_random_adapter(
    base_dir: str, out_dir: Path, seed: int, r: int = 16, b_scale: float = 0.01
) -> str:
    """A random adapter on every q/k/v/o/gate/up/down projection, written in PEFT's file
    layout straight from the base's config.json (no model load: what the benchmark uses
    on the real model, where loading it into PEFT once per adapter takes minutes on a
    shared host). `make_adapter` is the PEFT-made equivalent the exactness tests use.
    `b_scale` 0 gives an adapter that must change nothing."""
    import json

    from safetensors.torch import save_file

    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * b_scale
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": sorted({m.rsplit(".", 1)[1] for m in shapes}),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return str(out_dir)
