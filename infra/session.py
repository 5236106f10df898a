"""Where boto3 clients come from.

One function builds the session every command uses, so the region/profile rules live in one
place (``--region`` wins, then the boto3 default chain: ``AWS_REGION``, ``AWS_DEFAULT_REGION``,
the profile's config) and tests can swap in a session with extra event handlers.
:class:`Clients` makes that session on first use, so a command checks all of its own
arguments before a missing region can fail it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config

from infra.errors import DeployError

__all__ = ["Clients", "client_config", "make_session"]


def make_session(region: str | None = None, profile: str | None = None) -> boto3.Session:
    """A boto3 session for ``region``/``profile``; fails early when no region is known.

    Failing here (instead of at the first call) gives the user one clear line before any
    resource is touched.
    """
    session = boto3.Session(region_name=region or None, profile_name=profile or None)
    if not session.region_name:
        raise DeployError("no AWS region: pass --region or set AWS_REGION / AWS_DEFAULT_REGION")
    return session


def client_config(read_timeout_s: int = 60, max_attempts: int = 5) -> Config:
    """Client settings for control-plane and invoke calls.

    ``standard`` retry mode retries throttling and transient errors with backoff; the read
    timeout matters for ``InvokeEndpoint``, which may take up to 60 s by contract (the
    invoke client passes ~70 s and fewer attempts, since a retried generation costs GPU time).
    """
    return Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        read_timeout=read_timeout_s,
        user_agent_extra="hearth-deploy",
    )


class Clients:
    """The boto3 clients of one command, from a session made on the first call.

    ``clients("sagemaker")`` is a control-plane client (:func:`client_config` defaults);
    keyword arguments override them, e.g. ``clients("lambda", read_timeout_s=905)``.
    """

    def __init__(self, session: Callable[[], boto3.Session]) -> None:
        self._make_session = session
        self._session: boto3.Session | None = None

    def __call__(self, service: str, *, read_timeout_s: int = 60, max_attempts: int = 5) -> Any:
        if self._session is None:
            self._session = self._make_session()
        return self._session.client(
            service,
            config=client_config(read_timeout_s=read_timeout_s, max_attempts=max_attempts),
        )
