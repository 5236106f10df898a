"""AWS Lambda from the same container image, plus its Function URL.

Two ways to run the image on Lambda (no GPU there, so a small model on CPU):

* ``buffered``: the Lambda runtime interface client runs the Mangum handler
  ``container.lambda_handler.handler`` with the engine in-process.  The image's entrypoint is
  overridden with ``python -m awslambdaric``; responses (SSE included) come back whole, up to
  6 MB.
* ``stream``: the image runs ``hearth serve`` unchanged and the AWS Lambda Web Adapter (an
  extension copied into a derived image, see docs/deploy.md) proxies the Function URL to it
  in ``response_stream`` mode, so SSE streams token by token.

Lambda's filesystem is read-only except ``/tmp``, so ``HOME`` defaults to ``/tmp``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infra.errors import DeployError, if_exists
from infra.naming import DEPLOYMENT_TAG
from infra.results import Report, Result, Status
from infra.session import Clients

__all__ = [
    "DEFAULT_HANDLER",
    "LWA_ENVIRONMENT",
    "MODES",
    "PUBLIC_URL_STATEMENTS",
    "LambdaSpec",
    "delete_function",
    "deploy",
    "ensure_function",
    "ensure_function_url",
]

MODES = ("buffered", "stream")
DEFAULT_HANDLER = "container.lambda_handler.handler"
# The Lambda Web Adapter's settings for streaming hearth's SSE (awslabs/aws-lambda-web-adapter).
LWA_ENVIRONMENT = {
    "AWS_LWA_INVOKE_MODE": "response_stream",
    "AWS_LWA_PORT": "8080",
    "AWS_LWA_READINESS_CHECK_PATH": "/ping",
    "AWS_LWA_READINESS_CHECK_HEALTHY_STATUS": "200",
}
# Resource-policy statements a public (AuthType NONE) Function URL needs: anonymous callers
# need both lambda:InvokeFunctionUrl and lambda:InvokeFunction via the URL.
PUBLIC_URL_STATEMENTS = ("hearth-public-url", "hearth-public-url-invoke")
_PUBLIC_GRANTS: dict[str, dict[str, Any]] = {
    PUBLIC_URL_STATEMENTS[0]: {
        "Action": "lambda:InvokeFunctionUrl",
        "FunctionUrlAuthType": "NONE",
    },
    PUBLIC_URL_STATEMENTS[1]: {
        "Action": "lambda:InvokeFunction",
        "InvokedViaFunctionUrl": True,
    },
}
_BASE_ENVIRONMENT = {"HOME": "/tmp"}


@dataclass(frozen=True)
class LambdaSpec:
    """A container-image function and how it is reached."""

    name: str
    image_uri: str
    role_arn: str
    memory_mb: int = 10240
    timeout_s: int = 900
    environment: Mapping[str, str] = field(default_factory=dict)
    mode: str = "buffered"
    handler: str = DEFAULT_HANDLER
    serve_args: tuple[str, ...] = ()
    ephemeral_storage_mb: int | None = None
    architecture: str = "x86_64"
    url_auth: str | None = "AWS_IAM"

    def validate(self) -> None:
        """Lambda's documented limits, checked before any call."""
        if self.mode not in MODES:
            raise DeployError(f"mode must be one of {', '.join(MODES)}")
        if not 128 <= self.memory_mb <= 10240:
            raise DeployError(f"memory must be 128-10240 MB, got {self.memory_mb}")
        if not 1 <= self.timeout_s <= 900:
            raise DeployError(f"timeout must be 1-900 s, got {self.timeout_s}")
        if self.ephemeral_storage_mb is not None and not 512 <= self.ephemeral_storage_mb <= 10240:
            raise DeployError("ephemeral storage must be 512-10240 MB")
        if self.architecture not in ("x86_64", "arm64"):
            raise DeployError("architecture must be x86_64 or arm64")
        if self.url_auth not in (None, "AWS_IAM", "NONE"):
            raise DeployError("Function URL auth must be AWS_IAM or NONE")
        if not self.role_arn.startswith("arn:"):
            raise DeployError(f"execution role must be an IAM role ARN: {self.role_arn!r}")
        if self.serve_args and self.mode != "stream":
            # Buffered mode runs the Mangum handler, not `hearth serve`: the arguments
            # would be dropped, and an --api-key among them with them (a public URL
            # with no key and no warning).
            raise DeployError(
                "--serve-arg applies to --mode stream only (buffered mode runs the Lambda "
                "handler, not `hearth serve`); set flags as HEARTH_* variables with --env, "
                "e.g. --env HEARTH_API_KEY=..."
            )

    @property
    def has_api_key(self) -> bool:
        """Whether the server will demand a key (``HEARTH_API_KEY`` or ``--api-key``)."""
        if self.environment.get("HEARTH_API_KEY", "").strip(","):
            return True
        if self.mode != "stream":  # serve_args reach `hearth serve` in stream mode only
            return False
        return any(a == "--api-key" or a.startswith("--api-key=") for a in self.serve_args)

    @property
    def invoke_mode(self) -> str:
        """The Function URL invoke mode; must match ``AWS_LWA_INVOKE_MODE``."""
        return "RESPONSE_STREAM" if self.mode == "stream" else "BUFFERED"

    def image_config(self) -> dict[str, list[str]]:
        """``ImageConfig``: what the image runs on Lambda (see the module docstring)."""
        if self.mode == "stream":
            command = ["hearth", "serve", "--port", LWA_ENVIRONMENT["AWS_LWA_PORT"]]
            return {"EntryPoint": [], "Command": [*command, *self.serve_args]}
        return {"EntryPoint": ["python", "-m", "awslambdaric"], "Command": [self.handler]}

    def full_environment(self) -> dict[str, str]:
        """Defaults (``HOME=/tmp``, the adapter's settings in stream mode) under the user's."""
        env = dict(_BASE_ENVIRONMENT)
        if self.mode == "stream":
            env.update(LWA_ENVIRONMENT)
        env.update(self.environment)
        return env

    def configuration(self) -> dict[str, Any]:
        """Fields shared by ``CreateFunction`` and ``UpdateFunctionConfiguration``."""
        conf: dict[str, Any] = {
            "Role": self.role_arn,
            "MemorySize": self.memory_mb,
            "Timeout": self.timeout_s,
            "Environment": {"Variables": self.full_environment()},
            "ImageConfig": self.image_config(),
        }
        if self.ephemeral_storage_mb is not None:
            conf["EphemeralStorage"] = {"Size": self.ephemeral_storage_mb}
        return conf


def _get_function(lam: Any, name: str) -> dict[str, Any] | None:
    return if_exists(lam.get_function, FunctionName=name)


def _wait(lam: Any, waiter: str, name: str, delay_s: int) -> None:
    # Lambda rejects a second update while LastUpdateStatus is InProgress.
    lam.get_waiter(waiter).wait(
        FunctionName=name, WaiterConfig={"Delay": max(delay_s, 1), "MaxAttempts": 300}
    )


def _clean_image_config(conf: Mapping[str, Any]) -> dict[str, list[str]]:
    return {k: list(v) for k, v in conf.items() if k in ("EntryPoint", "Command") and v}


def _config_drift(current: Mapping[str, Any], spec: LambdaSpec) -> list[str]:
    """Names of the configuration fields that differ from ``spec``."""
    wanted = spec.configuration()
    drift = [key for key in ("Role", "MemorySize", "Timeout") if current.get(key) != wanted[key]]
    if current.get("Environment", {}).get("Variables", {}) != wanted["Environment"]["Variables"]:
        drift.append("Environment")
    have = _clean_image_config(current.get("ImageConfigResponse", {}).get("ImageConfig", {}))
    if have != _clean_image_config(wanted["ImageConfig"]):
        drift.append("ImageConfig")
    if spec.ephemeral_storage_mb is not None and (
        current.get("EphemeralStorage", {}).get("Size") != spec.ephemeral_storage_mb
    ):
        drift.append("EphemeralStorage")
    return drift


def ensure_function(
    lam: Any, spec: LambdaSpec, wait_delay_s: int = 5, *, adopt: bool = False
) -> Result:
    """Create the function, or bring its image and configuration up to ``spec``.

    The image is compared by URI: push each build under a new tag (a git SHA), because
    Lambda resolves a tag to a digest only when the code is (re)deployed. An existing
    function without our tag was made by someone else: it is refused unless ``adopt``
    (then tagged, so that ``delete`` may remove it later).
    """
    spec.validate()
    current = _get_function(lam, spec.name)
    if current is not None and current.get("Tags", {}).get(DEPLOYMENT_TAG) != spec.name:
        if not adopt:
            raise DeployError(
                f"function {spec.name} exists but has no {DEPLOYMENT_TAG}={spec.name} tag, so "
                "`hearth deploy lambda` did not create it; pass --adopt to take it over"
            )
        lam.tag_resource(
            Resource=current["Configuration"]["FunctionArn"], Tags={DEPLOYMENT_TAG: spec.name}
        )
    if current is None:
        conf = spec.configuration()
        conf["ImageConfig"] = _clean_image_config(conf["ImageConfig"])
        lam.create_function(
            FunctionName=spec.name,
            PackageType="Image",
            Code={"ImageUri": spec.image_uri},
            Architectures=[spec.architecture],
            Tags={DEPLOYMENT_TAG: spec.name},
            **conf,
        )
        _wait(lam, "function_active_v2", spec.name, wait_delay_s)
        return Result("lambda-function", spec.name, Status.CREATED, f"{spec.mode} mode")
    conf = current["Configuration"]
    if conf.get("PackageType") != "Image":
        raise DeployError(f"function {spec.name} exists but is not a container-image function")
    changed: list[str] = []
    architectures = conf.get("Architectures", ["x86_64"])
    if current.get("Code", {}).get("ImageUri") != spec.image_uri or architectures != [
        spec.architecture
    ]:
        lam.update_function_code(
            FunctionName=spec.name, ImageUri=spec.image_uri, Architectures=[spec.architecture]
        )
        _wait(lam, "function_updated_v2", spec.name, wait_delay_s)
        changed.append("image")
    drift = _config_drift(conf, spec)
    if drift:
        lam.update_function_configuration(FunctionName=spec.name, **spec.configuration())
        _wait(lam, "function_updated_v2", spec.name, wait_delay_s)
        changed += drift
    if not changed:
        return Result("lambda-function", spec.name, Status.UNCHANGED)
    return Result("lambda-function", spec.name, Status.UPDATED, ", ".join(changed))


def _policy_sids(lam: Any, name: str) -> set[str]:
    found = if_exists(lam.get_policy, FunctionName=name)
    if found is None:
        return set()
    policy = json.loads(found["Policy"])
    return {s.get("Sid", "") for s in policy.get("Statement", [])}


def _public_permissions(lam: Any, name: str, public: bool) -> list[Result]:
    """Grant (or revoke) what anonymous callers of a NONE-auth Function URL need:
    ``lambda:InvokeFunctionUrl`` and ``lambda:InvokeFunction`` via the URL."""
    sids = _policy_sids(lam, name)
    results: list[Result] = []
    for sid in PUBLIC_URL_STATEMENTS:
        if public and sid not in sids:
            lam.add_permission(
                FunctionName=name, StatementId=sid, Principal="*", **_PUBLIC_GRANTS[sid]
            )
            results.append(Result("permission", sid, Status.CREATED))
        elif not public and sid in sids:
            lam.remove_permission(FunctionName=name, StatementId=sid)
            results.append(Result("permission", sid, Status.DELETED))
    return results


def ensure_function_url(lam: Any, spec: LambdaSpec) -> list[Result]:
    """Create or update the Function URL (auth type and invoke mode) and its permissions."""
    if spec.url_auth is None:
        return []
    current = if_exists(lam.get_function_url_config, FunctionName=spec.name)
    if current is None:
        created = lam.create_function_url_config(
            FunctionName=spec.name, AuthType=spec.url_auth, InvokeMode=spec.invoke_mode
        )
        result = Result("function-url", created["FunctionUrl"], Status.CREATED, spec.url_auth)
    elif (current.get("AuthType"), current.get("InvokeMode", "BUFFERED")) != (
        spec.url_auth,
        spec.invoke_mode,
    ):
        updated = lam.update_function_url_config(
            FunctionName=spec.name, AuthType=spec.url_auth, InvokeMode=spec.invoke_mode
        )
        result = Result("function-url", updated["FunctionUrl"], Status.UPDATED, spec.url_auth)
    else:
        result = Result("function-url", current["FunctionUrl"], Status.UNCHANGED, spec.url_auth)
    return [result, *_public_permissions(lam, spec.name, spec.url_auth == "NONE")]


def delete_function(lam: Any, name: str) -> list[Result]:
    """Delete the Function URL and the function, if this tool created it (tag check)."""
    current = _get_function(lam, name)
    if current is None:
        return [Result("lambda-function", name, Status.ABSENT)]
    if current.get("Tags", {}).get(DEPLOYMENT_TAG) != name:
        raise DeployError(
            f"function {name} has no {DEPLOYMENT_TAG}={name} tag, so it was not created by "
            "`hearth deploy lambda`; delete it with the AWS console or CLI"
        )
    results: list[Result] = []
    url = if_exists(lam.get_function_url_config, FunctionName=name)
    # A URL that goes away between the two calls is as good as deleted.
    if url is not None and if_exists(lam.delete_function_url_config, FunctionName=name) is not None:
        results.append(Result("function-url", url["FunctionUrl"], Status.DELETED))
    lam.delete_function(FunctionName=name)
    results.append(Result("lambda-function", name, Status.DELETED))
    return results


def deploy(
    clients: Clients,
    spec: LambdaSpec,
    *,
    adopt: bool,
    report: Report,
    warn: Callable[[str], None],
) -> None:
    """``deploy lambda``: the function, then its Function URL and permissions.

    A public URL (``--url-auth NONE``) on a server without an API key lets anyone with
    the URL run the model; that is allowed (a demo may want it) but never silently.
    """
    spec.validate()
    if spec.url_auth == "NONE" and not spec.has_api_key:
        warn(
            "warning: the Function URL is public (--url-auth NONE) and the function has no "
            "API key (HEARTH_API_KEY): anyone with the URL can run the model. Set a key, "
            "e.g. from Secrets Manager (see docs/deploy.md), or use --url-auth AWS_IAM."
        )
    lam = clients("lambda")
    report(ensure_function(lam, spec, adopt=adopt))
    for result in ensure_function_url(lam, spec):
        report(result)
