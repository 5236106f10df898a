"""Names of the resources one deployment owns.

SageMaker models and endpoint configs are immutable: a change means a new resource.  Naming
them ``<deployment>-m-<hash>`` / ``<deployment>-c-<hash>`` from a hash of their content makes
every command idempotent (same input, same name, nothing to do), lets ``update`` roll an
endpoint to a new config without inventing version numbers, and lets ``delete`` find every
leftover of a deployment by name.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from infra.errors import DeployError

__all__ = [
    "DEPLOYMENT_TAG",
    "HASH_CHARS",
    "MAX_DEPLOYMENT_NAME",
    "content_hash",
    "derived_name",
    "is_derived_name",
    "is_owned",
    "resource_tags",
    "validate_deployment_name",
]

HASH_CHARS = 10
# SageMaker names are at most 63 characters; "-m-" plus the hash must still fit.
MAX_DEPLOYMENT_NAME = 63 - 3 - HASH_CHARS
# Tag put on everything a deployment creates; ``delete`` only removes tagged resources.
DEPLOYMENT_TAG = "hearth:deployment"

_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")


def validate_deployment_name(name: str) -> str:
    """Check ``name`` against SageMaker's endpoint-name rules before any call is made."""
    if not name or len(name) > MAX_DEPLOYMENT_NAME or not _NAME_RE.match(name):
        raise DeployError(
            f"invalid deployment name {name!r}: use 1-{MAX_DEPLOYMENT_NAME} letters, digits "
            "and hyphens, starting and ending with a letter or digit"
        )
    return name


def content_hash(content: Any) -> str:
    """A short stable hash of JSON-serialisable ``content`` (key order does not matter)."""
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:HASH_CHARS]


def derived_name(deployment: str, kind: str, content: Any) -> str:
    """``<deployment>-<kind>-<hash of content>``; ``kind`` is ``m`` (model) or ``c`` (config)."""
    return f"{deployment}-{kind}-{content_hash(content)}"


def is_derived_name(name: str, deployment: str, kind: str) -> bool:
    """Whether ``name`` was produced by :func:`derived_name` for this deployment and kind."""
    pattern = rf"^{re.escape(deployment)}-{re.escape(kind)}-[0-9a-f]{{{HASH_CHARS}}}$"
    return re.match(pattern, name) is not None


def resource_tags(sm: Any, arn: str) -> dict[str, str]:
    """The tags of a SageMaker resource, every page."""
    tags: dict[str, str] = {}
    for page in sm.get_paginator("list_tags").paginate(ResourceArn=arn):
        tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
    return tags


def is_owned(sm: Any, arn: str, deployment: str) -> bool:
    """Whether the resource carries this deployment's ownership tag."""
    return resource_tags(sm, arn).get(DEPLOYMENT_TAG) == deployment
