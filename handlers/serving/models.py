"""`GET /v1/models`: every served name, one card each."""

from __future__ import annotations

from handlers.protocol.models import ModelCard, ModelList
from handlers.serving.served_model import ServedModel


class ServingModels:
    def __init__(self, served: ServedModel) -> None:
        self.served = served

    def list(self) -> ModelList:
        """Answers while the engine is still loading too (then without max_model_len)."""
        info = self.served.engine.model_info
        root = self.served.config.model_dir or (info.model_dir if info else None)
        return ModelList(
            data=[
                ModelCard(
                    id=name,
                    root=root,
                    max_model_len=info.max_model_len if info else None,
                    architecture=info.architecture if info and info.architecture else None,
                )
                for name in self.served.names
            ]
        )
