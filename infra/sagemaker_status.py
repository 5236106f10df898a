"""Where a SageMaker endpoint stands: describe it, and wait until it settles.

Creating, updating and deleting an endpoint are asynchronous; every command that waits
goes through :func:`wait_for_endpoint` or :func:`wait_for_endpoint_deleted`, so the
progress lines, the time limit and the failure messages are the same everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from infra.errors import DeployError, if_exists

__all__ = [
    "TRANSITIONAL",
    "Progress",
    "Waiting",
    "describe_endpoint",
    "wait_for_endpoint",
    "wait_for_endpoint_deleted",
]

# States an endpoint passes through on its own; anything else is terminal.
TRANSITIONAL = frozenset({"Creating", "Updating", "SystemUpdating", "RollingBack", "Deleting"})

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    return None


def describe_endpoint(sm: Any, name: str) -> dict[str, Any] | None:
    """``DescribeEndpoint``, or ``None`` when there is no such endpoint."""
    return if_exists(sm.describe_endpoint, EndpointName=name)


@dataclass(frozen=True)
class Waiting:
    """How to wait for SageMaker: overall limit, poll interval, where progress goes.

    ``sleep`` and ``clock`` are injectable so tests can drive the loop without real time.
    """

    timeout_s: float = 3600.0
    poll_s: float = 15.0
    progress: Progress = _quiet
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _poll(sm: Any, name: str, waiting: Waiting) -> Iterator[dict[str, Any] | None]:
    """Yield fresh ``DescribeEndpoint`` results (``None`` once gone) until the caller stops,
    reporting each status change, and fail after ``waiting.timeout_s``."""
    start = waiting.clock()
    last: str | None = None
    while True:
        endpoint = describe_endpoint(sm, name)
        status = endpoint["EndpointStatus"] if endpoint else "gone"
        elapsed = waiting.clock() - start
        if status != last:
            waiting.progress(f"endpoint {name}: {status} ({_elapsed(elapsed)})")
            last = status
        yield endpoint
        if elapsed > waiting.timeout_s:
            raise DeployError(
                f"endpoint {name} still {status} after {_elapsed(elapsed)}; "
                "it may still finish: check it with `aws sagemaker describe-endpoint`"
            )
        waiting.sleep(waiting.poll_s)


def wait_for_endpoint(sm: Any, name: str, waiting: Waiting) -> dict[str, Any]:
    """Wait until the endpoint leaves its transitional states; fail unless ``InService``."""
    for endpoint in _poll(sm, name, waiting):
        if endpoint is None:
            raise DeployError(f"endpoint {name} disappeared while waiting for it")
        status = endpoint["EndpointStatus"]
        if status in TRANSITIONAL:
            continue
        if status != "InService":
            reason = endpoint.get("FailureReason", "no reason given")
            raise DeployError(f"endpoint {name} is {status}: {reason}")
        return endpoint
    raise AssertionError("unreachable")  # pragma: no cover


def wait_for_endpoint_deleted(sm: Any, name: str, waiting: Waiting) -> None:
    """Wait until ``DescribeEndpoint`` no longer finds the endpoint."""
    for endpoint in _poll(sm, name, waiting):
        if endpoint is None:
            return
        if endpoint["EndpointStatus"] != "Deleting":
            raise DeployError(f"endpoint {name} is {endpoint['EndpointStatus']}, not Deleting")
