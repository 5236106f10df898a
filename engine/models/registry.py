"""Architecture name (`config.architectures[0]`) → native model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.classifier import sequence_classifier
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.smollm3 import SmolLM3ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
"""Every architecture hearth serves natively; SmolLM/SmolLM2 checkpoints say LlamaForCausalLM."""

CLASSIFIER_BASES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
"""Decoders served with transformers' sequence-classification head too
(`Qwen3ForSequenceClassification`, ...: engine/models/classifier.py)."""
for _base in CLASSIFIER_BASES:
    _classifier = sequence_classifier(ARCHITECTURES[_base])
    ARCHITECTURES[_classifier.__name__] = _classifier

_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
"""Fallback for configs that name no architecture (hand-written or very old config.json)."""


def get_model_class(config: Any) -> type[nn.Module]:
    """The native class for `config`, or a ValueError that lists what is supported.

    `config.architectures[0]` decides; a config without it falls back on `model_type`.
    """
    supported = ", ".join(sorted(ARCHITECTURES))
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures:
        name = architectures[0]
    else:
        model_type = getattr(config, "model_type", None)
        if model_type not in _BY_MODEL_TYPE:
            raise ValueError(
                f"the model config names no architecture and its model_type {model_type!r} "
                f"is not supported; supported architectures: {supported}"
            )
        name = _BY_MODEL_TYPE[model_type]
    cls = ARCHITECTURES.get(name)
    if cls is None:
        raise ValueError(
            f"model architecture {name!r} is not supported; supported architectures: {supported}"
        )
    return cls
