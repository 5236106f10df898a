"""Fixtures for the infra tests: moto for every AWS API it implements, and two small,
faithful shims for the two calls moto 5.2.5 lacks.

* ``UpdateEndpoint`` is not implemented by moto.  :class:`UpdateEndpointShim` answers it
  from moto's own SageMaker backend (the endpoint switches config and goes ``Updating``,
  then ``InService`` on the next describe), so the rest of the flow stays on moto.
* ``InvokeEndpointWithResponseStream`` returns 404 in moto.  :class:`ResponseStreamShim`
  answers at the HTTP layer (``before-send``) with real binary AWS event-stream messages,
  so botocore's own ``EventStream`` parser, its ``PayloadPart`` handling and its
  ``ModelStreamError`` exception mapping all run for real.

No file here is imported by name (a ``tests/infra/__init__.py`` would shadow the real
``infra`` package): helpers are handed out through fixtures.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import struct
from binascii import crc32
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import botocore.loaders
import botocore.session
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError

ACCOUNT = "123456789012"
REGION = "us-east-1"


@functools.cache
def _shared_loader() -> botocore.loaders.Loader:
    return botocore.loaders.create_loader()


def fast_session(region: str = REGION) -> boto3.Session:
    """A plain boto3 session sharing one data loader with every other test session.

    ``boto3.client`` would parse the service models and the endpoints file again in each
    test (moto resets the default session), costing ~0.3 s per client.
    """
    core = botocore.session.get_session()
    core.register_component("data_loader", _shared_loader())
    return boto3.Session(botocore_session=core, region_name=region)


@pytest.fixture
def clients(aws: None) -> Any:
    """Un-shimmed clients for arranging and inspecting state: ``clients("s3")``."""
    session = fast_session()
    return session.client


# ---------------------------------------------------------------------------- environment


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Fake credentials and region; never read the developer's ~/.aws."""
    empty = tmp_path_factory.mktemp("aws-config")
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def aws() -> Iterator[None]:
    """moto for all services; Lambda without Docker (moto's simple backend)."""
    from moto import mock_aws

    with mock_aws(config={"lambda": {"use_docker": False}}):
        yield


@pytest.fixture
def role_arn(aws: None) -> str:
    """An IAM role both SageMaker and Lambda may assume (moto checks it exists)."""
    trust = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Service": ["sagemaker.amazonaws.com", "lambda.amazonaws.com"]},
                "Action": "sts:AssumeRole",
            }
        ],
    }
    iam = fast_session().client("iam")
    return iam.create_role(RoleName="hearth-test", AssumeRolePolicyDocument=json.dumps(trust))[
        "Role"
    ]["Arn"]


@pytest.fixture
def image() -> str:
    return f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/hearth:0.1.0"


def sagemaker_backend() -> Any:
    from moto.sagemaker.models import sagemaker_backends

    return sagemaker_backends[ACCOUNT][REGION]


@pytest.fixture
def sm_backend(aws: None) -> Any:
    """moto's in-process SageMaker backend, to inspect or force endpoint states."""
    return sagemaker_backend()


def queue_endpoint_results(*bodies: str, content_type: str = "application/json") -> None:
    """Queue canned ``InvokeEndpoint`` answers through moto's documented API."""
    import requests

    results = [
        {
            "Body": body,
            "ContentType": content_type,
            "InvokedProductionVariant": "AllTraffic",
            "CustomAttributes": "",
        }
        for body in bodies
    ]
    resp = requests.post(
        "http://motoapi.amazonaws.com/moto-api/static/sagemaker/endpoint-results",
        json={"account_id": ACCOUNT, "region": REGION, "results": results},
        timeout=5,
    )
    assert resp.status_code == 201, resp.text


def queue_lambda_result(payload: str) -> None:
    """Queue the payload moto's Docker-less Lambda backend returns for the next Invoke."""
    import requests

    resp = requests.post(
        "http://motoapi.amazonaws.com/moto-api/static/lambda-simple/response",
        json={"account_id": ACCOUNT, "region": REGION, "results": [payload]},
        timeout=5,
    )
    assert resp.status_code == 201, resp.text


@pytest.fixture
def moto_api() -> Any:
    """moto's result queues, as a fixture (see module docstring about imports)."""
    return argparse.Namespace(
        endpoint_results=queue_endpoint_results, lambda_result=queue_lambda_result
    )


# ---------------------------------------------------------------------------- event stream


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    # type 7 = string: 2-byte length + UTF-8 bytes
    return (
        struct.pack(">B", len(raw_name))
        + raw_name
        + b"\x07"
        + struct.pack(">H", len(raw_value))
        + raw_value
    )


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One binary AWS event-stream message (prelude, CRCs, string headers, payload)."""
    raw_headers = b"".join(_header(k, v) for k, v in headers.items())
    total = 12 + len(raw_headers) + len(payload) + 4
    prelude = struct.pack(">II", total, len(raw_headers))
    prelude += struct.pack(">I", crc32(prelude) & 0xFFFFFFFF)
    message = prelude + raw_headers + payload
    return message + struct.pack(">I", crc32(message) & 0xFFFFFFFF)


def payload_part(data: bytes) -> bytes:
    return encode_message(
        {
            ":message-type": "event",
            ":event-type": "PayloadPart",
            ":content-type": "application/octet-stream",
        },
        data,
    )


def exception_event(kind: str, message: str, error_code: str | None = None) -> bytes:
    body: dict[str, str] = {"Message": message}
    if error_code:
        body["ErrorCode"] = error_code
    return encode_message(
        {
            ":message-type": "exception",
            ":exception-type": kind,
            ":content-type": "application/json",
        },
        json.dumps(body).encode(),
    )


@pytest.fixture
def eventstream() -> Any:
    return argparse.Namespace(
        message=encode_message, payload_part=payload_part, exception=exception_event
    )


class _RawStream:
    """What botocore's EventStream reads: ``stream()`` yielding byte chunks."""

    def __init__(self, data: bytes, chunk_size: int) -> None:
        self._data = data
        self._chunk_size = chunk_size

    def stream(self, **_kwargs: Any) -> Iterator[bytes]:
        buf = io.BytesIO(self._data)
        while chunk := buf.read(self._chunk_size):
            yield chunk

    def close(self) -> None:
        return None


@dataclass
class ResponseStreamShim:
    """Serves ``InvokeEndpointWithResponseStream`` from queued event-stream messages."""

    responses: list[tuple[list[bytes], str]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    chunk_size: int = 7

    def queue(self, messages: list[bytes], content_type: str = "text/event-stream") -> None:
        self.responses.append((messages, content_type))

    def __call__(self, request: Any, **_kwargs: Any) -> AWSResponse | None:
        body = request.body
        self.requests.append(
            {
                "url": request.url,
                "headers": dict(request.headers),
                "body": json.loads(body.read() if hasattr(body, "read") else body),
            }
        )
        if not self.responses:
            raise AssertionError("no response stream queued")
        messages, content_type = self.responses.pop(0)
        headers = {
            "Content-Type": "application/vnd.amazon.eventstream",
            "X-Amzn-SageMaker-Content-Type": content_type,
            "x-Amzn-Invoked-Production-Variant": "AllTraffic",
        }
        raw = _RawStream(b"".join(messages), self.chunk_size)
        return AWSResponse(request.url, 200, headers, raw)

    def install(self, events: Any) -> None:
        events.register_first(
            "before-send.sagemaker-runtime.InvokeEndpointWithResponseStream", self
        )


# ---------------------------------------------------------------------------- UpdateEndpoint


@dataclass
class UpdateEndpointShim:
    """``UpdateEndpoint`` against moto's backend, with a realistic ``Updating`` phase:
    the first describe after the call shows ``Updating``, the next one ``InService`` on the
    new config (or, with ``fail_with``, ``InService`` rolled back to the old one)."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    fail_with: str | None = None
    pending: dict[str, str] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)

    def update(self, params: dict[str, Any], **_kwargs: Any) -> Any:
        request = json.loads(params["body"])
        self.calls.append(request)
        backend = sagemaker_backend()
        name, config = request["EndpointName"], request["EndpointConfigName"]
        for missing, what in ((name, backend.endpoints), (config, backend.endpoint_configs)):
            if missing not in what:
                error = {"Code": "ValidationException", "Message": f"Could not find {missing}"}
                raise ClientError({"Error": error}, "UpdateEndpoint")
        endpoint = backend.endpoints[name]
        endpoint.endpoint_status = "Updating"
        self.pending[name] = config
        self.seen.discard(name)
        return AWSResponse(params.get("url", ""), 200, {}, None), {"EndpointArn": endpoint.arn}

    def settle(self, params: dict[str, Any], **_kwargs: Any) -> None:
        name = json.loads(params["body"]).get("EndpointName")
        endpoint = sagemaker_backend().endpoints.get(name)
        if endpoint is None or name not in self.pending:
            return
        if name not in self.seen:
            self.seen.add(name)
            return
        config_name = self.pending.pop(name)
        if self.fail_with is None:
            config = sagemaker_backend().endpoint_configs[config_name]
            endpoint.endpoint_config_name = config_name
            endpoint.production_variants = endpoint._process_production_variants(
                config.production_variants
            )
        else:
            endpoint.failure_reason = self.fail_with
        endpoint.endpoint_status = "InService"

    def install(self, events: Any) -> None:
        events.register("before-call.sagemaker.UpdateEndpoint", self.update)
        events.register("before-call.sagemaker.DescribeEndpoint", self.settle)


@dataclass
class Shims:
    update: UpdateEndpointShim
    stream: ResponseStreamShim

    def session(self, region: str | None = None, profile: str | None = None) -> boto3.Session:
        """A boto3 session whose clients carry both shims (signature of make_session).

        All sessions share one botocore data loader: parsing the SageMaker service model
        again for every command would make each CLI test take seconds.
        """
        session = fast_session(region or REGION)
        events = session._session.get_component("event_emitter")
        self.update.install(events)
        self.stream.install(events)
        return session


@pytest.fixture
def shims(aws: None) -> Shims:
    return Shims(update=UpdateEndpointShim(), stream=ResponseStreamShim())


@pytest.fixture
def session(shims: Shims) -> boto3.Session:
    return shims.session()


# ---------------------------------------------------------------------------- CLI


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return [line for line in self.out.splitlines() if line]


@pytest.fixture
def cli(
    shims: Shims, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., CliResult]:
    """Run ``hearth <argv>`` through a parser built with ``add_commands``, on moto."""
    from infra import cli as cli_module

    monkeypatch.setattr(cli_module, "make_session", shims.session)
    parser = argparse.ArgumentParser(prog="hearth")
    cli_module.add_commands(parser.add_subparsers(dest="command", required=True))

    def run(*argv: str) -> CliResult:
        capsys.readouterr()
        args = parser.parse_args(list(argv))
        code = args.func(args)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
