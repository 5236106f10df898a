"""Where a LoRA adapter's files come from: a local directory, or an ``s3://`` URL fetched
with boto3 into a local one. Torch-free: the API worker fetches a run-time load's source
(off its event loop) before the engine reads it, and the engine fetches the start-up
``--lora-modules`` the same way.

An S3 source is a prefix holding ``adapter_config.json`` and the safetensors (every
object under it is downloaded, keeping relative paths), or one ``.tar.gz`` object
(SageMaker's artifact format), extracted with tarfile's ``data`` filter, which refuses
absolute paths, links out of the tree and device files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

S3_PREFIX = "s3://"


class AdapterSourceError(ValueError):
    """The source does not exist or cannot be fetched; the message says which and why."""


def default_fetch_root() -> Path:
    return Path(tempfile.gettempdir()) / f"hearth-adapters-{os.getuid()}"


def split_s3_url(url: str) -> tuple[str, str]:
    rest = url[len(S3_PREFIX) :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise AdapterSourceError(f"{url!r} names no bucket (use s3://bucket/prefix)")
    return bucket, key


def resolve_adapter_source(src: str, fetch_root: Path | None = None) -> str:
    """A local directory holding the adapter (an S3 source is downloaded first)."""
    if not src:
        raise AdapterSourceError("the adapter source is empty")
    if src.startswith(S3_PREFIX):
        return str(fetch_s3(src, fetch_root or default_fetch_root()))
    path = Path(src).expanduser()
    if not path.is_dir():
        raise AdapterSourceError(f"the adapter directory {src!r} does not exist")
    return str(path.resolve())


def fetch_s3(url: str, fetch_root: Path) -> Path:
    """Download an S3 prefix (or one .tar.gz object) into a fresh directory under
    `fetch_root`, named after the URL, and return it."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3_url(url)
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    fetch_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    dest = Path(tempfile.mkdtemp(prefix=f"{digest}-", dir=fetch_root))
    try:
        _download(boto3.client("s3"), bucket, key, url, dest)
        return _adapter_dir(dest, url)
    except (BotoCoreError, ClientError, tarfile.TarError, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise AdapterSourceError(f"cannot fetch {url}: {exc}") from None
    except AdapterSourceError:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _download(s3: Any, bucket: str, key: str, url: str, dest: Path) -> None:
    """The objects of `url` into `dest`: one archive extracted (tarfile's ``data`` filter
    refuses members that would land outside it), or every object under the prefix at its
    relative path, refusing a key whose rest would not (``..``, or absolute: S3 keys may
    hold ``//``, and joining an absolute path drops `dest`)."""
    if key.endswith((".tar.gz", ".tgz")):
        archive = dest / "adapter.tar.gz"
        s3.download_file(bucket, key, str(archive))
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
        archive.unlink()
        return
    prefix = key.rstrip("/") + "/" if key else ""
    root = dest.resolve()
    found = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rest = obj["Key"][len(prefix) :]
            relative = PurePosixPath(rest)
            if not relative.parts or obj["Key"].endswith("/"):
                continue
            target = dest.joinpath(*relative.parts)
            if (
                relative.is_absolute()
                or ".." in relative.parts
                or not target.resolve().is_relative_to(root)
            ):
                raise AdapterSourceError(f"{url}: object key {obj['Key']!r} leaves the prefix")
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))
            found += 1
    if not found:
        raise AdapterSourceError(f"{url} holds no objects")


def listed_source(src: str) -> str | None:
    """What the registry lists as an adapter's root for the source `src`: an s3:// URL
    as given (its download is removed once read); None for a local directory, listed by
    its resolved path."""
    return src if src.startswith(S3_PREFIX) else None


def discard_fetched(path: str, fetch_root: Path) -> None:
    """Remove the download `fetch_s3` made for an adapter at `path` (under `fetch_root`),
    once the engine has read it or refused it: the weights live in the engine's memory
    from registration on, and a copy per load would fill the disk over load / unload
    cycles. A path outside `fetch_root` (a local source) is left alone."""
    root = fetch_root.resolve()
    resolved = Path(path).resolve()
    if resolved == root or not resolved.is_relative_to(root):
        return
    shutil.rmtree(root / resolved.relative_to(root).parts[0], ignore_errors=True)


def _adapter_dir(dest: Path, url: str) -> Path:
    """The directory with adapter_config.json: the root, or its one subdirectory."""
    if (dest / "adapter_config.json").is_file():
        return dest
    subdirs = [p for p in dest.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and (subdirs[0] / "adapter_config.json").is_file():
        return subdirs[0]
    raise AdapterSourceError(f"{url} has no adapter_config.json")
