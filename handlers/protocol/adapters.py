"""LoRA adapter management bodies: SageMaker's `POST /adapters` and vLLM's
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`."""

from __future__ import annotations

from pydantic import Field

from handlers.protocol.base import OpenAIBaseModel

ADAPTER_NAME = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@-]*$")
"""What a request's `model` (or the adapter header) may then say."""


class RegisterAdapterRequest(OpenAIBaseModel):
    """SageMaker's adapter contract (AWS model-hosting-container-standards, sagemaker/lora)."""

    name: str = ADAPTER_NAME
    src: str = Field(min_length=1, max_length=4096)
    """A local directory or an ``s3://`` URL (a prefix, or one .tar.gz)."""
    preload: bool = True
    """Accepted for the contract; adapters are read at registration and made resident
    on their first request either way."""
    pin: bool = False
    """Accepted for the contract; not honoured (every adapter is evictable when idle)."""


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's `/v1/load_lora_adapter`."""

    lora_name: str = ADAPTER_NAME
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's `/v1/unload_lora_adapter`."""

    lora_name: str = ADAPTER_NAME
    lora_int_id: int | None = None
    """vLLM's numeric id: accepted and ignored (names identify adapters here)."""
