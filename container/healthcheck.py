"""The container's Docker ``HEALTHCHECK`` probe: ``python -m container.healthcheck``.

It asks ``/ping`` on loopback, the same readiness route SageMaker polls, so ``docker ps``
shows ``healthy`` exactly when SageMaker would route traffic.  The port is not fixed: the
SageMaker ``serve`` entrypoint listens on ``SAGEMAKER_BIND_TO_PORT`` (default 8080) and
``hearth serve`` on ``HEARTH_PORT`` (default 8000), so every candidate is tried and any 200
is healthy.  Standard library only: it must run in the slim image without extra packages.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

__all__ = ["candidate_ports", "main", "ping"]


def candidate_ports(env: Mapping[str, str]) -> list[int]:
    """Ports to probe, in order, without duplicates or junk values."""
    raw = [
        env.get("SAGEMAKER_BIND_TO_PORT", ""),
        env.get("HEARTH_PORT", ""),
        env.get("HEARTH_HEALTHCHECK_PORT", ""),
        "8080",
        "8000",
    ]
    ports: list[int] = []
    for value in raw:
        if value.strip().isdigit() and int(value) not in ports:
            ports.append(int(value))
    return ports


def ping(port: int, timeout_s: float = 2.0) -> bool:
    """Whether ``GET http://127.0.0.1:<port>/ping`` answers 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when any candidate port answers ``/ping`` with 200, else 1."""
    ports = [int(p) for p in (argv if argv is not None else sys.argv[1:])] or candidate_ports(
        os.environ
    )
    return 0 if any(ping(port) for port in ports) else 1


if __name__ == "__main__":
    sys.exit(main())
