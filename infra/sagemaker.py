"""SageMaker real-time endpoints: model, endpoint config, endpoint.

A deployment named ``N`` is three resources:

* model ``N-m-<hash>``: image, execution role, environment, model data;
* endpoint config ``N-c-<hash>``: one production variant (instance type and count, start-up
  and download timeouts, volume, host AMI) and optional detailed metrics;
* endpoint ``N``.

Models and configs cannot be changed in place, so their names hash their content
(:mod:`infra.naming`; the specs are in :mod:`infra.sagemaker_spec`). Deploying the same
inputs again is a no-op; deploying different inputs creates a new model/config and rolls
the endpoint onto it with ``UpdateEndpoint`` (no downtime), then deletes the superseded
ones. Waiting lives in :mod:`infra.sagemaker_status`, ownership and deletion in
:mod:`infra.sagemaker_cleanup`.
"""

from __future__ import annotations

from typing import Any

from infra.artifacts import ModelData
from infra.errors import DeployError, if_exists
from infra.inference_components import ensure_components
from infra.results import Report, Result, Results, Status, ignore
from infra.sagemaker_cleanup import delete_stale
from infra.sagemaker_spec import (
    ASYNC_MODE_ENV,
    AsyncSpec,
    EndpointSpec,
    MetricsSpec,
    ModelSpec,
    VariantSpec,
)
from infra.sagemaker_status import TRANSITIONAL, Waiting, describe_endpoint, wait_for_endpoint

__all__ = [
    "deploy_endpoint",
    "ensure_endpoint",
    "ensure_endpoint_config",
    "ensure_model",
    "read_spec",
]


# ---------------------------------------------------------------------------- read


def read_spec(sm: Any, name: str) -> EndpointSpec:
    """Rebuild the :class:`EndpointSpec` an existing endpoint runs, for ``deploy update``.

    Only single-variant endpoints (the kind this tool creates) can be read back.
    """
    endpoint = describe_endpoint(sm, name)
    if endpoint is None:
        raise DeployError(f"endpoint {name} not found; create it with `hearth deploy sagemaker`")
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    variants = config["ProductionVariants"]
    if len(variants) != 1:
        raise DeployError(f"endpoint {name} has {len(variants)} variants; only one is supported")
    pv = variants[0]
    if "ModelName" not in pv:
        raise DeployError(
            f"endpoint {name} serves inference components (--adapter); change it by running "
            "`hearth deploy sagemaker` again with the full arguments"
        )
    model = sm.describe_model(ModelName=pv["ModelName"])
    container = model.get("PrimaryContainer") or (model.get("Containers") or [{}])[0]
    metrics: MetricsSpec | None = None
    endpoints = container.get("ContainerMetricsConfig", {}).get("MetricsEndpoints") or []
    detailed = config.get("MetricsConfig", {}).get("EnableDetailedObservability")
    if endpoints or detailed:
        first = endpoints[0] if endpoints else {}
        metrics = MetricsSpec(
            path=first.get("MetricsEndpointPath", "/metrics"),
            frequency_s=first.get(
                "MetricPublishFrequencyInSeconds",
                config.get("MetricsConfig", {}).get("MetricPublishFrequencyInSeconds", 60),
            ),
        )
    async_inference = AsyncSpec.from_config(config.get("AsyncInferenceConfig"))
    environment = dict(container.get("Environment", {}))
    if async_inference is not None:  # the spec adds it back (sagemaker_spec.ASYNC_MODE_ENV)
        for key in ASYNC_MODE_ENV:
            environment.pop(key, None)
    return EndpointSpec(
        name=name,
        model=ModelSpec(
            image=container["Image"],
            role_arn=model["ExecutionRoleArn"],
            environment=environment,
            model_data=ModelData.from_container(container),
        ),
        variant=VariantSpec(
            instance_type=pv["InstanceType"],
            instance_count=pv.get("InitialInstanceCount", 1),
            name=pv["VariantName"],
            startup_timeout_s=pv.get("ContainerStartupHealthCheckTimeoutInSeconds"),
            download_timeout_s=pv.get("ModelDataDownloadTimeoutInSeconds"),
            volume_size_gb=pv.get("VolumeSizeInGB"),
            inference_ami_version=pv.get("InferenceAmiVersion"),
            routing_strategy=pv.get("RoutingConfig", {}).get("RoutingStrategy"),
        ),
        metrics=metrics,
        async_inference=async_inference,
    )


# ---------------------------------------------------------------------------- ensure


def ensure_model(sm: Any, spec: EndpointSpec) -> Result:
    """Create the model unless a model with its content-derived name already exists."""
    name = spec.model_name
    if if_exists(sm.describe_model, ModelName=name) is not None:
        return Result("model", name, Status.UNCHANGED)
    sm.create_model(**spec.model_request())
    return Result("model", name, Status.CREATED, spec.model.image)


def ensure_endpoint_config(sm: Any, spec: EndpointSpec) -> Result:
    """Create the endpoint config unless one with its content-derived name exists."""
    name = spec.config_name
    if if_exists(sm.describe_endpoint_config, EndpointConfigName=name) is not None:
        return Result("endpoint-config", name, Status.UNCHANGED)
    sm.create_endpoint_config(**spec.config_request())
    v = spec.variant
    return Result(
        "endpoint-config", name, Status.CREATED, f"{v.instance_count} x {v.instance_type}"
    )


def ensure_endpoint(sm: Any, spec: EndpointSpec, waiting: Waiting) -> Result:
    """Create the endpoint, or roll it onto ``spec``'s config when it runs another one.

    An endpoint still creating/updating (say, an interrupted earlier run) is waited for
    first, since SageMaker refuses to update it meanwhile.  A failed endpoint cannot be
    updated: the message says to delete it.
    """
    endpoint = describe_endpoint(sm, spec.name)
    if endpoint is None:
        sm.create_endpoint(
            EndpointName=spec.name, EndpointConfigName=spec.config_name, Tags=spec.tags
        )
        return Result("endpoint", spec.name, Status.CREATED, spec.config_name)
    if endpoint["EndpointStatus"] in TRANSITIONAL:
        waiting.progress(f"endpoint {spec.name}: waiting for {endpoint['EndpointStatus']}")
        endpoint = wait_for_endpoint(sm, spec.name, waiting)
    if endpoint["EndpointStatus"] == "Failed":
        raise DeployError(
            f"endpoint {spec.name} is Failed ({endpoint.get('FailureReason', 'no reason')}); "
            f"remove it with `hearth deploy delete --name {spec.name}` and deploy again"
        )
    if endpoint["EndpointConfigName"] == spec.config_name:
        return Result("endpoint", spec.name, Status.UNCHANGED, spec.config_name)
    sm.update_endpoint(EndpointName=spec.name, EndpointConfigName=spec.config_name)
    return Result(
        "endpoint",
        spec.name,
        Status.UPDATED,
        f"{endpoint['EndpointConfigName']} -> {spec.config_name}",
    )


# ---------------------------------------------------------------------------- deploy


def deploy_endpoint(
    sm: Any,
    spec: EndpointSpec,
    waiting: Waiting,
    *,
    wait: bool = True,
    prune: bool = True,
    report: Report = ignore,
) -> list[Result]:
    """Converge the endpoint to ``spec``: model, config, endpoint, then wait and prune.

    Each result is passed to ``report`` as soon as it happens (creation can take many
    minutes, the user should see "endpoint ...: created" before the wait).  After an update
    the endpoint must end up on the new config; SageMaker rolls a failed update back to the
    old one (status ``InService`` again), which is reported as an error.  Superseded
    configs/models are deleted only after a successful wait (``prune``).
    """
    spec.validate()
    if spec.uses_components and not wait:
        raise DeployError("--adapter needs the endpoint InService first: drop --no-wait")
    results = Results(report)
    results.add(ensure_model(sm, spec))
    results.add(ensure_endpoint_config(sm, spec))
    endpoint = results.add(ensure_endpoint(sm, spec, waiting))
    if not wait:
        return results.items
    if endpoint.status is not Status.UNCHANGED:
        described = wait_for_endpoint(sm, spec.name, waiting)
        if described["EndpointConfigName"] != spec.config_name:
            raise DeployError(
                f"update of endpoint {spec.name} was rolled back to "
                f"{described['EndpointConfigName']}: "
                f"{described.get('FailureReason', 'no reason given')}"
            )
    if spec.uses_components:  # the base moves to the new model before the old one goes
        for result in ensure_components(sm, spec.components(), waiting):
            results.add(result)
    if prune:
        for result in delete_stale(sm, spec.name, spec.config_name, spec.model_name):
            results.add(result)
    return results.items
