"""AWS failures become one clear line."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    ParamValidationError,
    WaiterError,
)

from infra.errors import DeployError, aws_errors, describe_error, is_not_found


def client_error(code: str, message: str, op: str = "CreateModel", **extra: object) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, **extra}, op)


def test_client_error_names_operation_code_and_message() -> None:
    line = describe_error(client_error("ValidationException", "bad\n instance   type"))
    assert line == "CreateModel failed: ValidationException: bad instance type"


def test_known_codes_get_a_hint() -> None:
    line = describe_error(client_error("AccessDeniedException", "no", op="CreateEndpoint"))
    assert line.startswith("CreateEndpoint failed: AccessDeniedException: no (")
    assert "IAM" in line


def test_model_error_shows_container_status_and_openai_message() -> None:
    original = json.dumps({"error": {"message": "prompt too long", "type": "x", "code": 400}})
    exc = client_error(
        "ModelError",
        "Received client error (400) from primary",
        op="InvokeEndpoint",
        OriginalStatusCode=400,
        OriginalMessage=original,
        LogStreamArn="arn:aws:logs:us-east-1:1:log-group:/aws/sagemaker/Endpoints/x",
    )
    line = describe_error(exc)
    assert line.startswith(
        "InvokeEndpoint failed: the model container answered 400: prompt too long"
    )
    assert "logs: arn:aws:logs" in line


def test_model_error_raised_by_botocore_keeps_original_fields() -> None:
    # The fields must survive botocore's own error parsing, not just a hand-made dict.
    from botocore.stub import Stubber

    rt = boto3.client("sagemaker-runtime", region_name="us-east-1")
    with Stubber(rt) as stub:
        stub.add_client_error(
            "invoke_endpoint",
            service_error_code="ModelError",
            service_message="Received server error (503)",
            http_status_code=424,
            response_meta={},
            modeled_fields={"OriginalStatusCode": 503, "OriginalMessage": "engine is dead"},
        )
        with pytest.raises(ClientError) as info:
            rt.invoke_endpoint(EndpointName="e", Body=b"{}")
    assert describe_error(info.value) == (
        "InvokeEndpoint failed: the model container answered 503: engine is dead"
    )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (NoCredentialsError(), "no usable AWS credentials"),
        (NoRegionError(), "no AWS region: pass --region"),
        (EndpointConnectionError(endpoint_url="https://x"), "cannot reach AWS"),
        (ParamValidationError(report="Invalid length"), "invalid request parameters"),
        (
            WaiterError(name="FunctionActiveV2", reason="Max attempts exceeded", last_response={}),
            "gave up waiting: FunctionActiveV2",
        ),
        (DeployError("plain"), "plain"),
    ],
)
def test_other_failures(exc: Exception, expected: str) -> None:
    line = describe_error(exc)
    assert line.startswith(expected)
    assert "\n" not in line


@pytest.mark.parametrize(
    ("code", "message", "expected"),
    [
        ("ValidationException", "Could not find endpoint 'arn:...'.", True),
        ("ValidationException", "Instance type not supported", False),
        ("ResourceNotFoundException", "Function not found", True),
        ("404", "Not Found", True),
        ("AccessDenied", "Could not find credentials", False),
    ],
)
def test_is_not_found(code: str, message: str, expected: bool) -> None:
    assert is_not_found(client_error(code, message)) is expected


def test_aws_errors_wraps_botocore_failures_with_the_action() -> None:
    with (
        pytest.raises(DeployError, match=r"^uploading: CreateModel failed: Throttling"),
        aws_errors("uploading"),
    ):
        raise client_error("ThrottlingException", "slow down")
    with pytest.raises(DeployError, match=r"^mine$"), aws_errors("x"):
        raise DeployError("mine")
