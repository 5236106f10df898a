"""`hearth batch`: a SageMaker batch transform job over JSON Lines in S3.

The job reads every object under ``--input``, splits it into lines (``SplitType=Line``),
packs many lines into each request (``BatchStrategy=MultiRecord``, at most
``MaxPayloadInMB``) and writes one output object per input object, one line per record
(``AssembleWith=Line``). hearth's ``/invocations`` runs every record of such a request
as its own request, all in one continuous batch, and answers one line each, in order
(``handlers/serving/jsonlines.py``); ``serve`` sees ``SAGEMAKER_BATCH=true`` and allows
an hour per request.

A job is immutable, so like models and configs its name hashes its content
(``<name>-t-<hash>``): running the same command again finds the job (whatever state it
is in) and creates nothing. The model is created (or found) the way ``deploy
sagemaker`` creates one, with the same ownership tag; a job of that name without the
tag is refused, never touched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from infra.artifacts import ModelSource, model_data
from infra.errors import DeployError, if_exists
from infra.naming import DEPLOYMENT_TAG, derived_name, is_owned, validate_deployment_name
from infra.results import Report, Result, Results, Status, ignore
from infra.sagemaker import ensure_model
from infra.sagemaker_spec import EndpointSpec, ModelSpec, VariantSpec, check_s3_uri
from infra.sagemaker_status import Waiting
from infra.session import Clients

__all__ = ["TransformSpec", "run_batch", "wait_for_transform"]

JSONLINES = "application/jsonlines"
DONE = ("Completed", "Failed", "Stopped")


@dataclass(frozen=True)
class TransformSpec:
    """One transform job: where the records are and go, and what runs them."""

    name: str
    input_s3: str
    output_s3: str
    instance_type: str
    instance_count: int = 1
    max_payload_mb: int = 6
    """Records packed into one request, at most (SageMaker: 0-100)."""
    max_concurrent_transforms: int | None = None
    """Requests in flight per instance; None asks the container (/execution-parameters)."""
    invocation_timeout_s: int = 3600
    """ModelClientConfig.InvocationsTimeoutInSeconds (1-3600; SageMaker's default is 600)."""

    def validate(self) -> None:
        validate_deployment_name(self.name)
        check_s3_uri("--input", self.input_s3)
        check_s3_uri("--output", self.output_s3)
        if self.instance_count < 1:
            raise DeployError("instance count must be at least 1")
        if not 0 <= self.max_payload_mb <= 100:
            raise DeployError(f"max payload must be 0-100 MB, got {self.max_payload_mb}")
        if not 1 <= self.invocation_timeout_s <= 3600:
            raise DeployError(
                f"invocation timeout must be 1-3600 s, got {self.invocation_timeout_s}"
            )
        n = self.max_concurrent_transforms
        if n is not None and n < 1:
            raise DeployError(f"max concurrent transforms must be at least 1, got {n}")

    def _content(self, model_name: str) -> dict[str, Any]:
        content: dict[str, Any] = {
            "ModelName": model_name,
            "BatchStrategy": "MultiRecord",
            "MaxPayloadInMB": self.max_payload_mb,
            "ModelClientConfig": {
                "InvocationsTimeoutInSeconds": self.invocation_timeout_s,
                "InvocationsMaxRetries": 0,
            },
            "TransformInput": {
                "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": self.input_s3}},
                "ContentType": JSONLINES,
                "SplitType": "Line",
            },
            "TransformOutput": {
                "S3OutputPath": self.output_s3,
                "Accept": JSONLINES,
                "AssembleWith": "Line",
            },
            "TransformResources": {
                "InstanceType": self.instance_type,
                "InstanceCount": self.instance_count,
            },
        }
        if self.max_concurrent_transforms is not None:
            content["MaxConcurrentTransforms"] = self.max_concurrent_transforms
        return content

    def job_name(self, model_name: str) -> str:
        """``<name>-t-<hash of the whole request>``: same inputs, same job."""
        return derived_name(self.name, "t", self._content(model_name))

    def request(self, model_name: str) -> dict[str, Any]:
        """Keyword arguments of ``CreateTransformJob``."""
        return {
            "TransformJobName": self.job_name(model_name),
            **self._content(model_name),
            "Tags": [{"Key": DEPLOYMENT_TAG, "Value": self.name}],
        }


def ensure_transform_job(sm: Any, spec: TransformSpec, model_name: str) -> Result:
    name = spec.job_name(model_name)
    job = if_exists(sm.describe_transform_job, TransformJobName=name)
    if job is None:
        sm.create_transform_job(**spec.request(model_name))
        return Result("transform-job", name, Status.CREATED, f"{spec.input_s3} -> {spec.output_s3}")
    if not is_owned(sm, job["TransformJobArn"], spec.name):
        raise DeployError(
            f"transform job {name} exists but was not created by hearth; not touching it"
        )
    return Result("transform-job", name, Status.UNCHANGED, job["TransformJobStatus"])


def wait_for_transform(sm: Any, name: str, waiting: Waiting) -> dict[str, Any]:
    """Poll until the job is Completed, Failed or Stopped (a failure is a DeployError)."""
    start = waiting.clock()
    last = None
    while True:
        job = sm.describe_transform_job(TransformJobName=name)
        status = job["TransformJobStatus"]
        if status != last:
            waiting.progress(f"transform-job {name}: {status}")
            last = status
        if status in DONE:
            if status != "Completed":
                reason = job.get("FailureReason", "no reason given")
                raise DeployError(f"transform job {name} is {status}: {reason}")
            return job
        if waiting.clock() - start > waiting.timeout_s:
            raise DeployError(f"transform job {name} still {status} after {waiting.timeout_s:g} s")
        waiting.sleep(waiting.poll_s)


def run_batch(
    clients: Clients,
    model: ModelSpec,
    spec: TransformSpec,
    waiting: Waiting,
    *,
    source: ModelSource = ModelSource(),
    wait: bool = True,
    report: Report = ignore,
) -> list[Result]:
    """Create (or find) the model and the transform job; then wait for the job unless
    ``wait`` is False."""
    spec.validate()
    model.validate()
    results = Results(report)
    data, uploaded = model_data(clients, source, spec.name, waiting.progress)
    if uploaded is not None:
        results.add(uploaded)
    # The model is named and created exactly as `deploy sagemaker` names and creates one.
    holder = EndpointSpec(
        spec.name, replace(model, model_data=data), VariantSpec(spec.instance_type)
    )
    sm = clients("sagemaker")
    results.add(ensure_model(sm, holder))
    job = results.add(ensure_transform_job(sm, spec, holder.model_name))
    if wait:
        wait_for_transform(sm, job.name, waiting)
    return results.items
