"""Model weights in S3, the way SageMaker wants them.

SageMaker gets model data in one of two shapes (botocore ``ContainerDefinition``):

* ``ModelDataUrl`` pointing at a ``model.tar.gz``, which SageMaker downloads and extracts to
  ``/opt/ml/model`` before the container starts;
* ``ModelDataSource.S3DataSource`` with ``S3DataType=S3Prefix`` and ``CompressionType=None``:
  an uncompressed prefix copied file by file, the better choice for multi-GB LLM weights
  (no gzip on either side).

:func:`package_and_upload` turns a local directory (or a single GGUF file) into the first
shape, idempotently: the object key and an S3 metadata entry carry a hash of the directory's
*content*, so a rerun with the same files neither re-compresses nor re-uploads anything, and a
changed file gives a new key, hence a new SageMaker model and a rolling update.
:func:`existing_model_data` accepts an ``s3://`` URI the user already has.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from botocore.exceptions import ClientError

from infra.errors import DeployError, aws_errors, error_code, is_not_found
from infra.results import Result, Status
from infra.session import Clients

__all__ = [
    "CONTENT_SHA256_METADATA",
    "ModelData",
    "ModelSource",
    "directory_digest",
    "existing_model_data",
    "model_data",
    "model_files",
    "package_and_upload",
    "parse_s3_uri",
    "write_model_tarball",
]

# S3 user metadata key (stored as x-amz-meta-hearth-content-sha256).
CONTENT_SHA256_METADATA = "hearth-content-sha256"
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class ModelData:
    """Where a model's weights live in S3 and whether they are a ``.tar.gz``."""

    uri: str
    compressed: bool

    @classmethod
    def from_uri(cls, uri: str) -> ModelData:
        """Classify an ``s3://`` URI: ``*.tar.gz`` is an archive, anything else a prefix.

        A prefix gets a trailing ``/`` so that ``s3://b/llama`` cannot also match
        ``s3://b/llama-old/...`` when SageMaker copies everything under it.
        """
        parse_s3_uri(uri)
        if uri.endswith(".tar.gz"):
            return cls(uri=uri, compressed=True)
        return cls(uri=uri if uri.endswith("/") else uri + "/", compressed=False)

    def container_fields(self) -> dict[str, Any]:
        """The ``ContainerDefinition`` fields that point SageMaker at this data."""
        if self.compressed:
            return {"ModelDataUrl": self.uri}
        return {
            "ModelDataSource": {
                "S3DataSource": {
                    "S3Uri": self.uri,
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            }
        }

    @classmethod
    def from_container(cls, container: dict[str, Any]) -> ModelData | None:
        """Read the model data back from a described ``PrimaryContainer``."""
        if container.get("ModelDataUrl"):
            return cls(uri=container["ModelDataUrl"], compressed=True)
        source = container.get("ModelDataSource", {}).get("S3DataSource")
        if source and source.get("S3Uri"):
            compressed = source.get("CompressionType", "None") != "None"
            return cls(uri=source["S3Uri"], compressed=compressed)
        return None


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into ``(bucket, key)``; reject anything else."""
    if not uri.startswith("s3://"):
        raise DeployError(f"not an S3 URI: {uri!r} (expected s3://bucket/key)")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise DeployError(f"S3 URI without a bucket: {uri!r}")
    return bucket, key


def model_files(path: Path) -> list[tuple[str, Path]]:
    """``(name in archive, file on disk)`` pairs for a model directory or a single file.

    Sorted for reproducibility.  Symlinks are followed, because Hugging Face cache snapshots
    are directories of links into a blob store.  Hidden entries (``.git``, ``.cache``,
    ``.DS_Store``) are skipped: they are never part of a model and can be huge.
    """
    if path.is_file():
        return [(path.name, path)]
    if not path.is_dir():
        raise DeployError(f"model path does not exist: {path}")
    files: list[tuple[str, Path]] = []
    for root, dirs, names in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if name.startswith("."):
                continue
            full = Path(root) / name
            if full.is_file():
                files.append((full.relative_to(path).as_posix(), full))
    if not files:
        raise DeployError(f"model directory is empty: {path}")
    return sorted(files)


def _iter_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            yield chunk


def directory_digest(files: list[tuple[str, Path]]) -> str:
    """SHA-256 over names, sizes and contents: the identity of a model's weights.

    Hashing the content rather than the archive means a rerun can find the upload in S3
    without compressing anything (gzip of multi-GB weights is the slow part).
    """
    outer = hashlib.sha256()
    for name, full in files:
        inner = hashlib.sha256()
        size = 0
        for chunk in _iter_chunks(full):
            inner.update(chunk)
            size += len(chunk)
        outer.update(f"{name}\0{size}\0{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


def write_model_tarball(files: list[tuple[str, Path]], out: IO[bytes]) -> None:
    """Write a reproducible ``model.tar.gz`` (files at the archive root) to ``out``.

    Owner, mode and mtime are normalised and gzip's timestamp is zero, so the same files give
    the same bytes.  Level 1 compression: weights barely compress and level 6 costs minutes.
    """
    with (
        gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, full in files:
            info = tarfile.TarInfo(name)
            info.size = full.stat().st_size
            info.mode = 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with full.open("rb") as fh:
                tar.addfile(info, fh)


def _head(s3: Any, bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if error_code(exc) == "NoSuchBucket":
            raise DeployError(f"S3 bucket {bucket} does not exist") from exc
        if is_not_found(exc):
            return None
        raise


def package_and_upload(
    s3: Any,
    model_path: Path,
    bucket: str,
    prefix: str,
    progress: Callable[[str], None] = lambda _msg: None,
) -> tuple[ModelData, Result]:
    """Upload ``model_path`` as ``s3://bucket/prefix/model-<hash>.tar.gz`` unless present.

    The object is considered present when it carries our content-hash metadata with the same
    value.  Returns the :class:`ModelData` to give SageMaker and what was done.
    """
    files = model_files(model_path)
    digest = directory_digest(files)
    key = f"{prefix.strip('/')}/model-{digest[:16]}.tar.gz".lstrip("/")
    uri = f"s3://{bucket}/{key}"
    head = _head(s3, bucket, key)
    if head is not None and head.get("Metadata", {}).get(CONTENT_SHA256_METADATA) == digest:
        return ModelData(uri=uri, compressed=True), Result("model-data", uri, Status.UNCHANGED)
    total = sum(full.stat().st_size for _, full in files)
    progress(f"packaging {len(files)} file(s), {total / 2**20:.1f} MiB, into {uri}")
    with tempfile.TemporaryDirectory(prefix="hearth-model-") as tmp:
        archive = Path(tmp) / "model.tar.gz"
        with archive.open("wb") as out:
            write_model_tarball(files, out)
        progress(f"uploading {archive.stat().st_size / 2**20:.1f} MiB to {uri}")
        with aws_errors(f"uploading {uri}"):
            s3.upload_file(
                str(archive),
                bucket,
                key,
                ExtraArgs={
                    "Metadata": {CONTENT_SHA256_METADATA: digest},
                    "ContentType": "application/gzip",
                },
            )
    status = Status.CREATED if head is None else Status.UPDATED
    return ModelData(uri=uri, compressed=True), Result("model-data", uri, status)


def existing_model_data(s3: Any, uri: str) -> tuple[ModelData, Result]:
    """Accept model data already in S3, after checking it is really there.

    A typo in the URI would otherwise surface only when SageMaker fails to download it,
    many minutes into endpoint creation.
    """
    data = ModelData.from_uri(uri)
    bucket, key = parse_s3_uri(data.uri)
    if data.compressed:
        if _head(s3, bucket, key) is None:
            raise DeployError(f"model archive not found: {data.uri}")
        detail = "existing archive"
    else:
        listing = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
        if not listing.get("KeyCount") and not listing.get("Contents"):
            raise DeployError(f"no objects under model prefix: {data.uri}")
        detail = "existing prefix, uncompressed"
    return data, Result("model-data", data.uri, Status.UNCHANGED, detail)


@dataclass(frozen=True)
class ModelSource:
    """Where a deploy command was told the weights are: a local path to upload, an
    ``s3://`` URI that already holds them, or neither (keep or omit model data)."""

    local_path: Path | None = None
    s3_uri: str | None = None
    bucket: str | None = None
    prefix: str | None = None


def model_data(
    clients: Clients,
    source: ModelSource,
    deployment: str,
    progress: Callable[[str], None] = lambda _msg: None,
) -> tuple[ModelData | None, Result | None]:
    """The model data ``source`` names, uploaded first when it is local (under
    ``hearth/<deployment>`` unless a prefix is given); ``(None, None)`` for no source."""
    if source.local_path is not None:
        if not source.bucket:
            raise DeployError("--model-dir needs --bucket to upload the model to")
        s3 = clients("s3")
        prefix = source.prefix or f"hearth/{deployment}"
        return package_and_upload(s3, source.local_path, source.bucket, prefix, progress)
    if source.s3_uri:
        return existing_model_data(clients("s3"), source.s3_uri)
    return None, None
