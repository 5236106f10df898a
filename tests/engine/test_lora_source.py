"""Where adapters come from: local directories, and S3 (moto) as a prefix or a .tar.gz,
including the refusals (missing, empty, no adapter_config.json, a key escaping the
prefix)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from engine.lora_source import AdapterSourceError, discard_fetched, resolve_adapter_source

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"\x00" * 64}


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="adapters")
        yield client


def test_a_local_directory_is_used_in_place(tmp_path: Path) -> None:
    assert resolve_adapter_source(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(AdapterSourceError, match="does not exist"):
        resolve_adapter_source(str(tmp_path / "missing"))
    with pytest.raises(AdapterSourceError, match="empty"):
        resolve_adapter_source("")


def test_an_s3_prefix_is_downloaded(s3, tmp_path: Path) -> None:
    for name, data in FILES.items():
        s3.put_object(Bucket="adapters", Key=f"team/a1/{name}", Body=data)
    s3.put_object(Bucket="adapters", Key="team/a10/adapter_config.json", Body=b"{}")  # a sibling
    local = Path(resolve_adapter_source("s3://adapters/team/a1/", tmp_path))
    assert {p.name: p.read_bytes() for p in local.iterdir()} == FILES
    assert local.is_relative_to(tmp_path)


def test_an_s3_tarball_is_extracted(s3, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in FILES.items():
            info = tarfile.TarInfo(f"adapter/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    s3.put_object(Bucket="adapters", Key="a2/model.tar.gz", Body=buf.getvalue())
    local = Path(resolve_adapter_source("s3://adapters/a2/model.tar.gz", tmp_path))
    assert (local / "adapter_model.safetensors").read_bytes() == FILES["adapter_model.safetensors"]


def test_s3_refusals(s3, tmp_path: Path) -> None:
    with pytest.raises(AdapterSourceError, match="holds no objects"):
        resolve_adapter_source("s3://adapters/nothing/", tmp_path)
    s3.put_object(Bucket="adapters", Key="junk/readme.txt", Body=b"hi")
    with pytest.raises(AdapterSourceError, match=r"adapter_config\.json"):
        resolve_adapter_source("s3://adapters/junk", tmp_path)
    with pytest.raises(AdapterSourceError, match="cannot fetch"):
        resolve_adapter_source("s3://no-such-bucket/x/", tmp_path)
    with pytest.raises(AdapterSourceError, match="no bucket"):
        resolve_adapter_source("s3:///x", tmp_path)


def _tarball(members: dict[str, bytes], link: tuple[str, str] | None = None) -> bytes:
    """A .tar.gz of `members`, and a symbolic link (name, target) when given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link[0])
            info.type, info.linkname = tarfile.SYMTYPE, link[1]
            tar.addfile(info)
    return buf.getvalue()


def test_an_s3_key_that_would_leave_the_download_is_refused(s3, tmp_path: Path) -> None:
    """S3 keys may hold ``//``: under the prefix ``team/a1/`` the key
    ``team/a1//<dir>/pwned`` has an absolute rest, and joining it drops the download
    directory (the file would be written at ``<dir>/pwned``, anywhere the server may
    write). It is refused, nothing is written there, and the download is removed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "fetch"
    for name, data in FILES.items():
        s3.put_object(Bucket="adapters", Key=f"team/a1/{name}", Body=data)
    s3.put_object(Bucket="adapters", Key=f"team/a1/{outside}/pwned", Body=b"owned")
    with pytest.raises(AdapterSourceError, match="leaves the prefix"):
        resolve_adapter_source("s3://adapters/team/a1/", root)
    assert list(outside.iterdir()) == []
    assert list(root.iterdir()) == []


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"hello, not a tarball", "cannot fetch"),
        (_tarball({"../escape/adapter_config.json": b"{}"}), "cannot fetch"),
        (_tarball(FILES, link=("adapter_model.bin", "/etc/passwd")), "cannot fetch"),
    ],
    ids=["not-gzip", "dot-dot-member", "link-outside"],
)
def test_a_bad_s3_tarball_is_the_sources_error(
    s3, tmp_path: Path, body: bytes, needle: str
) -> None:
    """Not an archive, or a member the `data` filter refuses: the source's error (the
    routes' 400 / 424 on `src`), not a server error, and no download is left behind."""
    s3.put_object(Bucket="adapters", Key="a3/model.tar.gz", Body=body)
    root = tmp_path / "fetch"
    with pytest.raises(AdapterSourceError, match=needle):
        resolve_adapter_source("s3://adapters/a3/model.tar.gz", root)
    assert list(root.iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_a_read_download_is_discarded_and_a_local_source_kept(s3, tmp_path: Path) -> None:
    """Once the engine holds the weights, the fetched copy goes (one per load would fill
    the disk over load / unload cycles); a local directory is never touched."""
    for name, data in FILES.items():
        s3.put_object(Bucket="adapters", Key=f"team/a1/{name}", Body=data)
    root = tmp_path / "fetch"
    fetched = resolve_adapter_source("s3://adapters/team/a1/", root)
    assert Path(fetched).is_dir()
    discard_fetched(fetched, root)
    assert list(root.iterdir()) == []
    local = tmp_path / "local"
    local.mkdir()
    discard_fetched(str(local), root)
    discard_fetched(str(root), root)
    assert local.is_dir() and root.is_dir()
