"""Sequence classifiers: transformers' `*ForSequenceClassification` on a decoder.

The decoder is the causal LM's, unchanged (`model.*` tensors); the head is `score`, a
bias-free ``[num_labels, hidden]`` linear applied to the last token's final hidden
state, which is what transformers computes for an unpadded sequence. Such checkpoints
are rerankers (Qwen3-Reranker's sequence-classification conversions, bge-reranker-v2-
gemma), reward models and text classifiers. They generate nothing: there is no LM head,
the engine core refuses generation requests for them, and the pooler
(`engine/pooler.py`) runs `classify` on each pooled row instead of returning it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.layers.linear import Linear, Shard
from engine.models.llama import LlamaForCausalLM
from engine.models.weights import load_checkpoint

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"
"""The suffix of the architectures this module serves (`Qwen3ForSequenceClassification`)."""


def sequence_classifier(base: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """`base` (a causal LM class) with its LM head replaced by the `score` head."""

    class SequenceClassifier(base):  # type: ignore[valid-type, misc]
        def __init__(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
            super().__init__(config, dtype, device)
            del self.lm_head  # untied, it was allocated but never touched
            self.num_labels = int(config.num_labels)
            self.score = Linear(
                self.hidden_size,
                self.num_labels,
                [Shard("score", self.num_labels)],
                bias=False,
                dtype=dtype,
                device=device,
            )

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            """The classifier's float32 logits [N, num_labels] of these rows (what a
            memory profile of the head runs; nothing is ever sampled from them)."""
            return self.classify(hidden)

        def classify(self, hidden: torch.Tensor) -> torch.Tensor:
            """Float32 logits [N, num_labels]; the matmul in the model dtype, as
            transformers computes `score(hidden_states)`."""
            return self.score(hidden.to(self.dtype)).float()

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            load_checkpoint(self, weights, ignore=("lm_head.weight",))

    name = base.__name__.removesuffix("ForCausalLM") + SEQUENCE_CLASSIFICATION
    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = name
    SequenceClassifier.__doc__ = f"{base.__name__}'s decoder with a sequence-classification head."
    return SequenceClassifier


def is_classifier(model: nn.Module) -> bool:
    return callable(getattr(model, "classify", None))
