"""`GET /v1/models`: every served name, one card each, then each LoRA adapter with its
`parent` (the base model's name), as vLLM lists them; `GET /v1/models/{model}`: one of
those cards (OpenAI's retrieve-model route, which vLLM lacks: `client.models.retrieve`
gets a 404 there)."""

from __future__ import annotations

from handlers.errors import NotFoundError
from handlers.protocol.models import ModelCard, ModelList
from handlers.serving.adapters import ServingAdapters
from handlers.serving.served_model import ServedModel


class ServingModels:
    def __init__(self, served: ServedModel, adapters: ServingAdapters | None = None) -> None:
        self.served = served
        self.adapters = adapters or ServingAdapters(served)

    async def list(self) -> ModelList:
        """Answers while the engine is still loading too (then without max_model_len or
        adapters)."""
        info = self.served.engine.model_info
        root = self.served.config.model_dir or (info.model_dir if info else None)
        max_model_len = info.max_model_len if info else None
        architecture = info.architecture if info and info.architecture else None
        cards = [
            ModelCard(id=name, root=root, max_model_len=max_model_len, architecture=architecture)
            for name in self.served.names
        ]
        if info is not None and self.served.config.enable_lora:
            parent = self.served.config.default_model_name
            cards += [
                ModelCard(id=a.name, root=a.path, parent=parent, max_model_len=max_model_len)
                for a in await self.adapters.list()
            ]
        return ModelList(data=cards)

    async def retrieve(self, name: str) -> ModelCard:
        """The card `list` holds for `name` (a served name or a loaded adapter); 404 in
        OpenAI's shape, naming `model`, for any other."""
        for card in (await self.list()).data:
            if card.id == name:
                return card
        raise NotFoundError(f"The model `{name}` does not exist.", param="model")
