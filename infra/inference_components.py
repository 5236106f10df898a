"""Adapter inference components: LoRA adapters as SageMaker resources on one base model.

``hearth deploy sagemaker --adapter NAME=s3://...`` makes the endpoint one for inference
components: its config names no model (``ExecutionRoleArn`` instead), a *base* component
``<name>-base`` runs the model on the variant, and each adapter is an *adapter* component
``<name>-<adapter>`` whose ``BaseInferenceComponentName`` is the base and whose artifact is
the adapter's S3 URL (AWS's model-hosting-container-standards, ``sagemaker/lora/``).
Callers pick an adapter with ``InvokeEndpoint(InferenceComponentName=<name>-<adapter>)``;
SageMaker loads it into the base's containers through the container's ``/adapters`` route
and sends the adapter's name in ``X-Amzn-SageMaker-Adapter-Identifier``.

Components can be updated in place, so their names are stable (not content hashes): a
rerun compares what runs with what is asked and creates, updates or deletes only the
difference. Every component carries the deployment tag; one without it is never touched.
moto does not model inference components, so these calls are tested with botocore's
Stubber (tests/infra/test_infra_inference_components.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infra.errors import DeployError, if_exists
from infra.naming import DEPLOYMENT_TAG, is_owned
from infra.results import Result, Status
from infra.sagemaker_status import Waiting

__all__ = [
    "AdapterSpec",
    "ComponentsSpec",
    "delete_components",
    "ensure_components",
    "parse_adapters",
]

_ADAPTER_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")
_MAX_NAME = 63
BASE = "base"


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter: its name and the S3 URL of its artifact (a PEFT directory as a
    ``.tar.gz`` or an S3 prefix)."""

    name: str
    artifact_url: str

    def validate(self) -> None:
        if not _ADAPTER_NAME.match(self.name) or self.name == BASE:
            raise DeployError(
                f"adapter name {self.name!r}: letters, digits and hyphens, not {BASE!r}"
            )
        if not self.artifact_url.startswith("s3://") or len(self.artifact_url) <= 5:
            raise DeployError(f"adapter {self.name}: the artifact must be an s3:// URL")


def parse_adapters(pairs: Sequence[str] | None) -> tuple[AdapterSpec, ...]:
    """``["name=s3://...", ...]``; a name given twice is an error."""
    adapters: dict[str, AdapterSpec] = {}
    for pair in pairs or []:
        name, sep, url = pair.partition("=")
        if not sep or not name.strip():
            raise DeployError(f"--adapter expects NAME=s3://..., got {pair!r}")
        if name.strip() in adapters:
            raise DeployError(f"--adapter {name.strip()} is given twice")
        adapters[name.strip()] = AdapterSpec(name.strip(), url.strip())
    return tuple(adapters.values())


@dataclass(frozen=True)
class ComponentsSpec:
    """The base component and its adapters on endpoint ``deployment``."""

    deployment: str
    variant_name: str
    model_name: str
    adapters: tuple[AdapterSpec, ...]
    accelerators: int | None = 1
    """Accelerator devices per copy of the base (None: a CPU instance)."""
    min_memory_mb: int = 1024
    startup_timeout_s: int | None = None
    download_timeout_s: int | None = None

    def validate(self) -> None:
        for adapter in self.adapters:
            adapter.validate()
            if len(self.component_name(adapter.name)) > _MAX_NAME:
                raise DeployError(f"adapter name {adapter.name!r} makes a name over 63 characters")

    @property
    def tags(self) -> list[dict[str, str]]:
        return [{"Key": DEPLOYMENT_TAG, "Value": self.deployment}]

    @property
    def base_name(self) -> str:
        return self.component_name(BASE)

    def component_name(self, suffix: str) -> str:
        return f"{self.deployment}-{suffix}"

    def base_specification(self) -> dict[str, Any]:
        resources: dict[str, Any] = {"MinMemoryRequiredInMb": self.min_memory_mb}
        if self.accelerators is not None:
            resources["NumberOfAcceleratorDevicesRequired"] = self.accelerators
        spec: dict[str, Any] = {
            "ModelName": self.model_name,
            "ComputeResourceRequirements": resources,
        }
        startup = {
            "ContainerStartupHealthCheckTimeoutInSeconds": self.startup_timeout_s,
            "ModelDataDownloadTimeoutInSeconds": self.download_timeout_s,
        }
        startup = {k: v for k, v in startup.items() if v is not None}
        if startup:
            spec["StartupParameters"] = startup
        return spec

    def base_request(self) -> dict[str, Any]:
        """Keyword arguments of ``CreateInferenceComponent`` for the base model."""
        return {
            "InferenceComponentName": self.base_name,
            "EndpointName": self.deployment,
            "VariantName": self.variant_name,
            "Specification": self.base_specification(),
            "RuntimeConfig": {"CopyCount": 1},
            "Tags": self.tags,
        }

    def adapter_specification(self, adapter: AdapterSpec) -> dict[str, Any]:
        return {
            "BaseInferenceComponentName": self.base_name,
            "Container": {"ArtifactUrl": adapter.artifact_url},
        }

    def adapter_request(self, adapter: AdapterSpec) -> dict[str, Any]:
        """Keyword arguments of ``CreateInferenceComponent`` for one adapter (no variant,
        no resources, no copies: it lives in the base's containers)."""
        return {
            "InferenceComponentName": self.component_name(adapter.name),
            "EndpointName": self.deployment,
            "Specification": self.adapter_specification(adapter),
            "Tags": self.tags,
        }


# ---------------------------------------------------------------------------- calls


def _describe(sm: Any, name: str) -> dict[str, Any] | None:
    return if_exists(sm.describe_inference_component, InferenceComponentName=name)


def _check_owned(sm: Any, component: dict[str, Any], deployment: str) -> None:
    if not is_owned(sm, component["InferenceComponentArn"], deployment):
        raise DeployError(
            f"inference component {component['InferenceComponentName']} exists but was not "
            "created by hearth; not touching it"
        )


def _wait(sm: Any, name: str, waiting: Waiting, *, gone: bool = False) -> None:
    """Until the component is InService (or, with ``gone``, deleted)."""
    start = waiting.clock()
    last = None
    while True:
        component = _describe(sm, name)
        status = component["InferenceComponentStatus"] if component else "gone"
        if status != last:
            waiting.progress(f"inference-component {name}: {status}")
            last = status
        if gone and component is None:
            return
        if not gone and status == "InService":
            return
        if not gone and status == "Failed":
            reason = (component or {}).get("FailureReason", "no reason given")
            raise DeployError(f"inference component {name} failed: {reason}")
        if waiting.clock() - start > waiting.timeout_s:
            raise DeployError(
                f"inference component {name} still {status} after {waiting.timeout_s:g} s"
            )
        waiting.sleep(waiting.poll_s)


def _ensure(
    sm: Any,
    deployment: str,
    name: str,
    wanted: dict[str, Any],
    request: dict[str, Any],
    waiting: Waiting,
) -> Result:
    """Create the component, or update it in place when its specification differs."""
    current = _describe(sm, name)
    if current is None:
        sm.create_inference_component(**request)
        _wait(sm, name, waiting)
        return Result("inference-component", name, Status.CREATED)
    _check_owned(sm, current, deployment)
    runs = current.get("Specification", {})
    if all(runs.get(key) == value for key, value in wanted.items()):
        return Result("inference-component", name, Status.UNCHANGED)
    update = {"InferenceComponentName": name, "Specification": wanted}
    if "RuntimeConfig" in request:
        update["RuntimeConfig"] = request["RuntimeConfig"]
    sm.update_inference_component(**update)
    _wait(sm, name, waiting)
    return Result("inference-component", name, Status.UPDATED)


def _owned_components(sm: Any, deployment: str) -> list[str]:
    names: list[str] = []
    pages = sm.get_paginator("list_inference_components").paginate(EndpointNameEquals=deployment)
    for page in pages:
        for summary in page.get("InferenceComponents", []):
            if is_owned(sm, summary["InferenceComponentArn"], deployment):
                names.append(summary["InferenceComponentName"])
    return names


def ensure_components(sm: Any, spec: ComponentsSpec, waiting: Waiting) -> list[Result]:
    """Converge the endpoint's components to ``spec``: the base first (adapters need it
    InService), then each adapter; then delete our adapters that are no longer asked for."""
    spec.validate()
    results = [
        _ensure(
            sm,
            spec.deployment,
            spec.base_name,
            spec.base_specification(),
            spec.base_request(),
            waiting,
        )
    ]
    wanted = {spec.base_name}
    for adapter in spec.adapters:
        name = spec.component_name(adapter.name)
        wanted.add(name)
        results.append(
            _ensure(
                sm,
                spec.deployment,
                name,
                spec.adapter_specification(adapter),
                spec.adapter_request(adapter),
                waiting,
            )
        )
    for name in _owned_components(sm, spec.deployment):
        if name not in wanted:
            sm.delete_inference_component(InferenceComponentName=name)
            _wait(sm, name, waiting, gone=True)
            results.append(Result("inference-component", name, Status.DELETED))
    return results


def delete_components(sm: Any, deployment: str, waiting: Waiting) -> list[Result]:
    """Delete every component of ours on the endpoint, adapters before the base."""
    base = f"{deployment}-{BASE}"
    names = sorted(_owned_components(sm, deployment), key=lambda n: n == base)
    results = []
    for name in names:
        sm.delete_inference_component(InferenceComponentName=name)
        _wait(sm, name, waiting, gone=True)
        results.append(Result("inference-component", name, Status.DELETED))
    return results
