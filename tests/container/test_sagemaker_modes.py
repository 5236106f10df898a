"""`serve`'s SageMaker modes as arguments: the request timeout by mode, batch
transform's payload size and AWS's session variables (the real-server checks are in
tests/e2e/test_sagemaker_sessions_batch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from container.sagemaker_serve import sagemaker_argv
from container.settings import parse_serve_args, serve_configs


def _server_config(environ: dict[str, str], tmp_path: Path):
    argv = sagemaker_argv(environ, model_dir=tmp_path / "none")
    _, server = serve_configs(parse_serve_args(argv[1:], {}))
    return server


@pytest.mark.parametrize(
    ("environ", "timeout"),
    [
        ({}, 60.0),
        ({"HEARTH_SAGEMAKER_MODE": "async"}, 3600.0),
        ({"SAGEMAKER_BATCH": "true"}, 3600.0),
        ({"HEARTH_SAGEMAKER_MODE": "realtime", "SAGEMAKER_BATCH": "true"}, 60.0),
        ({"HEARTH_SAGEMAKER_REALTIME_TIMEOUT": "5"}, 5.0),
        ({"HEARTH_SAGEMAKER_MODE": "async", "HEARTH_SAGEMAKER_REALTIME_TIMEOUT": "5"}, 3600.0),
        ({"SM_HEARTH_REQUEST_TIMEOUT": "90", "HEARTH_SAGEMAKER_MODE": "async"}, 90.0),
    ],
)
def test_request_timeout_follows_the_mode(environ, timeout, tmp_path) -> None:
    assert _server_config(environ, tmp_path).request_timeout == timeout


def test_batch_payload_size_and_aws_session_variables(tmp_path) -> None:
    server = _server_config(
        {
            "SAGEMAKER_BATCH": "true",
            "SAGEMAKER_MAX_PAYLOAD_IN_MB": "20",
            "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true",
            "SAGEMAKER_SESSIONS_EXPIRATION": "300",
        },
        tmp_path,
    )
    assert server.max_request_body_bytes == 20 << 20
    assert server.enable_stateful_sessions and server.session_ttl == 300.0
    plain = _server_config({}, tmp_path)
    assert not plain.enable_stateful_sessions and plain.max_request_body_bytes == 6 << 20


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"HEARTH_SAGEMAKER_MODE": "streaming"}, "HEARTH_SAGEMAKER_MODE"),
        ({"HEARTH_SAGEMAKER_REALTIME_TIMEOUT": "-1"}, "positive number"),
        ({"SAGEMAKER_MAX_PAYLOAD_IN_MB": "lots"}, "SAGEMAKER_MAX_PAYLOAD_IN_MB"),
    ],
)
def test_bad_mode_variables_stop_with_one_line(environ, message, tmp_path) -> None:
    with pytest.raises(SystemExit, match=message):
        sagemaker_argv(environ, model_dir=tmp_path / "none")
