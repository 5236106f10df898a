"""A model directory's `config.json`, read without transformers when that is exact.

transformers' AutoConfig is the authority on each architecture's defaults, but importing
it costs the engine about a second and a half of start-up (LlamaConfig's module pulls in
activations, hub kernels and torch.distributed). A Llama config that spells out every
field the native model reads, with plain RoPE, needs none of those defaults: its values
are the file's. Anything else (another architecture, a missing field, RoPE scaling, a
config transformers would reject) still goes through AutoConfig, so no model is read
differently from before; tests/engine/test_model_config.py compares the two.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
)
"""Fields LlamaConfig would otherwise default; the light path needs each in the file."""


def read_model_config(model_dir: str | Path) -> Any:
    """The config of `model_dir`: a namespace of config.json for a complete plain Llama
    config, else transformers' AutoConfig (local files only)."""
    raw = _read_json(Path(model_dir) / "config.json")
    if raw is not None and _plain_llama(raw):
        values = dict(raw)
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
        return SimpleNamespace(**values)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # AutoConfig reports it in its own words
    return value if isinstance(value, dict) else None


def _plain_llama(raw: dict[str, Any]) -> bool:
    if raw.get("model_type") != "llama" or raw.get("architectures") != ["LlamaForCausalLM"]:
        return False
    if not all(_positive_int(raw.get(k)) for k in _REQUIRED if k != "tie_word_embeddings"):
        return False
    if not isinstance(raw.get("tie_word_embeddings"), bool):
        return False
    if raw["hidden_size"] % raw["num_attention_heads"]:
        return False  # AutoConfig refuses it, with its message
    if not isinstance(raw.get("rms_norm_eps"), float):
        return False
    return _plain_rope(raw)


def _plain_rope(raw: dict[str, Any]) -> bool:
    """RoPE without scaling, its theta given (either transformers 5's or 4's spelling)."""
    params = raw.get("rope_parameters")
    if params is not None:
        return (
            isinstance(params, dict)
            and set(params) == {"rope_type", "rope_theta"}
            and params["rope_type"] == "default"
            and isinstance(params["rope_theta"], int | float)
            and "rope_theta" not in raw
            and raw.get("rope_scaling") is None
        )
    return isinstance(raw.get("rope_theta"), int | float) and raw.get("rope_scaling") is None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
