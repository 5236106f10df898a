"""What a SageMaker deployment consists of, as plain values, and the API requests they make.

Kept apart from :mod:`infra.sagemaker` (which talks to AWS) so the specs can be built,
validated, compared and hashed without a client: ``deploy update`` reads a spec back from a
running endpoint, overlays the user's changes, and the resulting names tell whether anything
changed at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infra.artifacts import ModelData
from infra.errors import DeployError
from infra.inference_components import AdapterSpec, ComponentsSpec
from infra.naming import DEPLOYMENT_TAG, derived_name

__all__ = [
    "ASYNC_MODE_ENV",
    "DEFAULT_VARIANT",
    "METRIC_FREQUENCIES",
    "ROUTING_STRATEGIES",
    "AsyncSpec",
    "EndpointSpec",
    "MetricsSpec",
    "ModelSpec",
    "VariantSpec",
]

DEFAULT_VARIANT = "AllTraffic"
METRIC_FREQUENCIES = (10, 30, 60, 120, 180, 240, 300)
ROUTING_STRATEGIES = ("LEAST_OUTSTANDING_REQUESTS", "RANDOM", "PREFIX_AWARE", "KV_AWARE")
ADAPTER_ENV = {"SM_HEARTH_ENABLE_LORA": "true", "SM_HEARTH_ENABLE_RUNTIME_LORA_UPDATING": "true"}
"""What a base model of adapter inference components needs: LoRA on, and the /adapters
route through which SageMaker loads each adapter component into its containers (without
them the platform's load gets a 404 and the adapter never serves)."""
ASYNC_MODE_ENV = {"HEARTH_SAGEMAKER_MODE": "async"}
"""What tells `serve` it runs behind an async endpoint (SageMaker itself says nothing):
its request timeout is then an hour instead of InvokeEndpoint's 60 s."""
# ContainerDefinition.Environment limits (botocore sagemaker model).
_ENV_MAX_ENTRIES = 100
_ENV_MAX_BYTES = 1024
_ENV_MAX_TOTAL = 32 * 1024


@dataclass(frozen=True)
class MetricsSpec:
    """Prometheus scraping of the container by SageMaker (detailed observability).

    Off unless asked: it publishes CloudWatch metrics, which cost money.  hearth serves
    Prometheus text on ``/metrics`` on the serving port, which is also SageMaker's default.
    """

    path: str = "/metrics"
    frequency_s: int = 60

    def validate(self) -> None:
        """Reject values SageMaker would reject, before anything is created."""
        if self.frequency_s not in METRIC_FREQUENCIES:
            raise DeployError(
                f"metrics frequency must be one of {', '.join(map(str, METRIC_FREQUENCIES))} s"
            )
        if not self.path.startswith("/") or ".." in self.path:
            raise DeployError(f"metrics path must start with / and not contain '..': {self.path}")


def check_s3_uri(label: str, uri: str) -> None:
    if not uri.startswith("s3://") or len(uri) <= len("s3://") or uri[5] == "/":
        raise DeployError(f"{label} must be an s3://bucket/prefix URI, not {uri!r}")


@dataclass(frozen=True)
class AsyncSpec:
    """An asynchronous endpoint (``AsyncInferenceConfig``): requests are queued by
    SageMaker, read from S3 and answered into ``output_s3`` (payloads to 1 GB, up to an
    hour each); ``failure_s3`` receives the errors."""

    output_s3: str
    failure_s3: str | None = None
    max_concurrent_invocations: int | None = None
    """Per instance (1-1000); None: SageMaker's choice."""

    def validate(self) -> None:
        check_s3_uri("--output", self.output_s3)
        if self.failure_s3 is not None:
            check_s3_uri("--failure-output", self.failure_s3)
        n = self.max_concurrent_invocations
        if n is not None and not 1 <= n <= 1000:
            raise DeployError(f"max concurrent invocations must be 1-1000, got {n}")

    def config(self) -> dict[str, Any]:
        """The ``AsyncInferenceConfig`` of ``CreateEndpointConfig``."""
        output: dict[str, Any] = {"S3OutputPath": self.output_s3}
        if self.failure_s3 is not None:
            output["S3FailurePath"] = self.failure_s3
        config: dict[str, Any] = {"OutputConfig": output}
        if self.max_concurrent_invocations is not None:
            config["ClientConfig"] = {
                "MaxConcurrentInvocationsPerInstance": self.max_concurrent_invocations
            }
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> AsyncSpec | None:
        if not config:
            return None
        output = config.get("OutputConfig", {})
        return cls(
            output_s3=output["S3OutputPath"],
            failure_s3=output.get("S3FailurePath"),
            max_concurrent_invocations=config.get("ClientConfig", {}).get(
                "MaxConcurrentInvocationsPerInstance"
            ),
        )


@dataclass(frozen=True)
class ModelSpec:
    """What runs: the image, the role SageMaker assumes to pull it and the data, and the
    container environment (``HEARTH_*`` / ``SM_HEARTH_*`` variables configure ``serve``)."""

    image: str
    role_arn: str
    environment: Mapping[str, str] = field(default_factory=dict)
    model_data: ModelData | None = None

    def validate(self) -> None:
        """Check the Environment limits SageMaker enforces (100 entries, 1 KiB, 32 KiB)."""
        env = dict(self.environment)
        if len(env) > _ENV_MAX_ENTRIES:
            raise DeployError(f"at most {_ENV_MAX_ENTRIES} environment variables are allowed")
        total = 0
        for key, value in env.items():
            if not key or len(key.encode()) > _ENV_MAX_BYTES:
                raise DeployError(f"environment name must be 1-1024 bytes: {key!r}")
            if len(value.encode()) > _ENV_MAX_BYTES:
                raise DeployError(f"environment value of {key} is over 1024 bytes")
            total += len(key.encode()) + len(value.encode())
        if total > _ENV_MAX_TOTAL:
            raise DeployError("environment is over SageMaker's 32 KiB total")
        if not self.image:
            raise DeployError("an image URI is required")
        if not self.role_arn.startswith("arn:"):
            raise DeployError(f"execution role must be an IAM role ARN: {self.role_arn!r}")


@dataclass(frozen=True)
class VariantSpec:
    """Where it runs: one production variant.

    ``startup_timeout_s`` must cover loading the weights and warming the engine (``/ping``
    answers 503 until then); ``download_timeout_s`` covers copying the model data from S3.
    Both are 60-3600 s.  ``volume_size_gb`` only applies to instance types without local NVMe
    (not ml.g5/g6/p4/p5), so it is unset unless given.  ``inference_ami_version`` selects a
    host AMI with a newer NVIDIA driver, needed by recent CUDA images.
    """

    instance_type: str
    instance_count: int = 1
    name: str = DEFAULT_VARIANT
    startup_timeout_s: int | None = 900
    download_timeout_s: int | None = 1200
    volume_size_gb: int | None = None
    inference_ami_version: str | None = None
    routing_strategy: str | None = None

    def validate(self) -> None:
        """Range checks from the SageMaker API reference."""
        if self.instance_count < 1:
            raise DeployError("instance count must be at least 1")
        for label, value in (
            ("container start-up timeout", self.startup_timeout_s),
            ("model download timeout", self.download_timeout_s),
        ):
            if value is not None and not 60 <= value <= 3600:
                raise DeployError(f"{label} must be 60-3600 s, got {value}")
        if self.volume_size_gb is not None and not 1 <= self.volume_size_gb <= 512:
            raise DeployError(f"volume size must be 1-512 GB, got {self.volume_size_gb}")
        if self.routing_strategy is not None and self.routing_strategy not in ROUTING_STRATEGIES:
            raise DeployError(f"routing strategy must be one of {', '.join(ROUTING_STRATEGIES)}")

    def production_variant(self, model_name: str | None) -> dict[str, Any]:
        """The ``ProductionVariant`` entry of ``CreateEndpointConfig``; ``model_name``
        None for an endpoint of inference components (the start-up timeouts then belong
        to the base component)."""
        variant: dict[str, Any] = {
            "VariantName": self.name,
            "InstanceType": self.instance_type,
            "InitialInstanceCount": self.instance_count,
        }
        optional: dict[str, Any] = {
            "VolumeSizeInGB": self.volume_size_gb,
            "InferenceAmiVersion": self.inference_ami_version,
        }
        if model_name is not None:
            variant["ModelName"] = model_name
            optional["ContainerStartupHealthCheckTimeoutInSeconds"] = self.startup_timeout_s
            optional["ModelDataDownloadTimeoutInSeconds"] = self.download_timeout_s
        variant.update({k: v for k, v in optional.items() if v is not None})
        if self.routing_strategy:
            variant["RoutingConfig"] = {"RoutingStrategy": self.routing_strategy}
        return variant


@dataclass(frozen=True)
class EndpointSpec:
    """A whole deployment: endpoint name, model and variant, optional metrics, and
    optionally asynchronous inference."""

    name: str
    model: ModelSpec
    variant: VariantSpec
    metrics: MetricsSpec | None = None
    async_inference: AsyncSpec | None = None
    adapters: tuple[AdapterSpec, ...] = ()
    """LoRA adapters as adapter inference components (infra/inference_components.py):
    with any, the endpoint is one of inference components."""

    def validate(self) -> None:
        """Validate every part; called before the first AWS call."""
        self.model.validate()
        self.variant.validate()
        if self.metrics is not None:
            self.metrics.validate()
        if self.async_inference is not None:
            self.async_inference.validate()
        if self.adapters:
            if self.async_inference is not None:
                raise DeployError("--adapter and --async cannot be combined")
            self.components().validate()

    @property
    def uses_components(self) -> bool:
        return bool(self.adapters)

    def components(self) -> ComponentsSpec:
        """The base component (this spec's model on its variant) and the adapters."""
        family = self.variant.instance_type.removeprefix("ml.").split(".")[0]
        accelerated = family.startswith(("g", "p", "inf", "trn"))
        return ComponentsSpec(
            deployment=self.name,
            variant_name=self.variant.name,
            model_name=self.model_name,
            adapters=self.adapters,
            accelerators=1 if accelerated else None,
            startup_timeout_s=self.variant.startup_timeout_s,
            download_timeout_s=self.variant.download_timeout_s,
        )

    @property
    def tags(self) -> list[dict[str, str]]:
        """Tags put on every resource of the deployment; ``delete`` relies on them."""
        return [{"Key": DEPLOYMENT_TAG, "Value": self.name}]

    def _container(self) -> dict[str, Any]:
        container: dict[str, Any] = {"Image": self.model.image}
        environment = dict(self.model.environment)
        if self.async_inference is not None:
            environment.update(ASYNC_MODE_ENV)
        if self.adapters:
            environment = {**ADAPTER_ENV, **environment}  # the user's own settings win
        if environment:
            container["Environment"] = dict(sorted(environment.items()))
        if self.model.model_data is not None:
            container.update(self.model.model_data.container_fields())
        if self.metrics is not None:
            container["ContainerMetricsConfig"] = {
                "MetricsEndpoints": [
                    {
                        "MetricsEndpointPath": self.metrics.path,
                        "MetricPublishFrequencyInSeconds": self.metrics.frequency_s,
                    }
                ]
            }
        return container

    def _model_content(self) -> dict[str, Any]:
        return {"ExecutionRoleArn": self.model.role_arn, "PrimaryContainer": self._container()}

    @property
    def model_name(self) -> str:
        """``<name>-m-<hash of image, role, environment, data, metrics endpoint>``."""
        return derived_name(self.name, "m", self._model_content())

    def model_request(self) -> dict[str, Any]:
        """Keyword arguments of ``CreateModel``."""
        return {"ModelName": self.model_name, **self._model_content(), "Tags": self.tags}

    def _config_content(self) -> dict[str, Any]:
        if self.uses_components:  # the model is named by the base component, not here
            content: dict[str, Any] = {
                "ProductionVariants": [self.variant.production_variant(None)],
                "ExecutionRoleArn": self.model.role_arn,
            }
        else:
            content = {"ProductionVariants": [self.variant.production_variant(self.model_name)]}
        if self.metrics is not None:
            content["MetricsConfig"] = {
                "EnableDetailedObservability": True,
                "MetricPublishFrequencyInSeconds": self.metrics.frequency_s,
            }
        if self.async_inference is not None:
            content["AsyncInferenceConfig"] = self.async_inference.config()
        return content

    @property
    def config_name(self) -> str:
        """``<name>-c-<hash of the variant (which names the model) and metrics config>``."""
        return derived_name(self.name, "c", self._config_content())

    def config_request(self) -> dict[str, Any]:
        """Keyword arguments of ``CreateEndpointConfig``."""
        return {"EndpointConfigName": self.config_name, **self._config_content(), "Tags": self.tags}
