"""vLLM's `POST /classify`: each input through the served sequence classifier
(`engine/models/classifier.py`), answered with its class probabilities and the most
probable label. The engine returns the head's float32 logits; the activation the model
prescribes (`ClassifierConfig.activation`, read as vLLM reads it) is applied here, unless
the request says `use_activation: false`."""

from __future__ import annotations

import numpy as np

from engine.messages import PoolingParams
from engine.pooling_config import ClassifierConfig
from handlers.protocol.embedding import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
)
from handlers.serving.context import RequestContext
from handlers.serving.embedding import ServingEmbedding, pooled_values


class ServingClassification(ServingEmbedding):
    kind = "classify"
    id_prefix = "classify"

    async def create_classification(
        self, request: ClassificationRequest, ctx: RequestContext
    ) -> ClassificationResponse:
        model_name = self.model_name(request.model)
        head = self.classifier("/classify")
        pooled = await self.embed(request, ctx, PoolingParams())
        data = []
        for i, raw in enumerate(pooled.vectors):
            probs = activate(logits_of(raw), head, request.use_activation)
            best = int(np.argmax(probs))
            data.append(
                ClassificationData(
                    index=i,
                    label=head.labels[best] if best < len(head.labels) else None,
                    probs=probs.tolist(),
                    num_classes=len(probs),
                )
            )
        return ClassificationResponse(
            id=pooled.response_id, model=model_name, data=data, usage=pooled.usage()
        )


def logits_of(raw: bytes) -> np.ndarray:
    """The engine's float32 logits, as float64."""
    return pooled_values(raw).astype(np.float64)


def activate(logits: np.ndarray, head: ClassifierConfig, use_activation: bool | None) -> np.ndarray:
    """vLLM's classifier activation: softmax over two or more labels, sigmoid for one
    label or a multi-label model, none for a regression model or with
    `use_activation: false`."""
    if use_activation is False or head.activation == "identity":
        return logits
    if head.activation == "sigmoid" or len(logits) < 2:
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()
