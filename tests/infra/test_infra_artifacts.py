"""Model data packaging and idempotent upload to S3 (moto)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from infra.artifacts import (
    CONTENT_SHA256_METADATA,
    ModelData,
    existing_model_data,
    model_files,
    package_and_upload,
    write_model_tarball,
)
from infra.errors import DeployError
from infra.results import Status

BUCKET = "hearth-models"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    root = tmp_path / "smol"
    (root / "tokenizer").mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(os.urandom(4096))
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    (root / ".cache").mkdir()
    (root / ".cache" / "junk").write_text("never shipped")
    (root / ".DS_Store").write_text("junk")
    blob = tmp_path / "blob"
    blob.write_text("linked weights")
    (root / "linked.bin").symlink_to(blob)  # HF cache snapshots are symlinks
    return root


@pytest.fixture
def s3(clients: Any) -> Any:
    client = clients("s3")
    client.create_bucket(Bucket=BUCKET)
    return client


class PutCounter:
    """Counts S3 writes, to prove a rerun uploads nothing."""

    def __init__(self, client: Any) -> None:
        self.count = 0
        client.meta.events.register("before-call.s3.PutObject", self._hit)
        client.meta.events.register("before-call.s3.CreateMultipartUpload", self._hit)

    def _hit(self, **_kwargs: Any) -> None:
        self.count += 1


def test_model_files_follow_symlinks_and_skip_hidden(model_dir: Path) -> None:
    names = [name for name, _ in model_files(model_dir)]
    assert names == ["config.json", "linked.bin", "model.safetensors", "tokenizer/tokenizer.json"]


def test_single_file_is_packaged_at_the_root(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert [name for name, _ in model_files(gguf)] == ["model.gguf"]


def test_missing_or_empty_model_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="does not exist"):
        model_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DeployError, match="empty"):
        model_files(tmp_path / "empty")


def test_tarball_is_reproducible_and_extracts_to_the_root(model_dir: Path) -> None:
    files = model_files(model_dir)
    first, second = io.BytesIO(), io.BytesIO()
    write_model_tarball(files, first)
    os.utime(model_dir / "config.json", (1, 1))  # mtimes must not matter
    write_model_tarball(files, second)
    assert first.getvalue() == second.getvalue()
    with tarfile.open(fileobj=io.BytesIO(first.getvalue()), mode="r:gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {n for n, _ in files}
        assert members["linked.bin"].isfile()  # a real file, not a link
        assert tar.extractfile("linked.bin").read() == b"linked weights"  # type: ignore[union-attr]
        assert all(m.uid == 0 and m.mtime == 0 for m in members.values())


def test_upload_then_rerun_is_unchanged_without_writes(s3: Any, model_dir: Path) -> None:
    data, result = package_and_upload(s3, model_dir, BUCKET, "hearth/demo")
    assert result.status is Status.CREATED
    assert data.compressed and data.uri.startswith(f"s3://{BUCKET}/hearth/demo/model-")
    key = data.uri.removeprefix(f"s3://{BUCKET}/")
    head = s3.head_object(Bucket=BUCKET, Key=key)
    assert len(head["Metadata"][CONTENT_SHA256_METADATA]) == 64
    body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as tar:
        assert tar.extractfile("config.json").read() == b'{"model_type": "llama"}'  # type: ignore[union-attr]

    puts = PutCounter(s3)
    again, result2 = package_and_upload(s3, model_dir, BUCKET, "hearth/demo")
    assert (again, result2.status) == (data, Status.UNCHANGED)
    assert puts.count == 0


def test_changed_content_gets_a_new_key(s3: Any, model_dir: Path) -> None:
    first, _ = package_and_upload(s3, model_dir, BUCKET, "p")
    (model_dir / "config.json").write_text('{"model_type": "qwen2"}')
    second, result = package_and_upload(s3, model_dir, BUCKET, "p")
    assert result.status is Status.CREATED
    assert second.uri != first.uri


def test_object_without_our_metadata_is_replaced(s3: Any, model_dir: Path) -> None:
    data, _ = package_and_upload(s3, model_dir, BUCKET, "p")
    key = data.uri.removeprefix(f"s3://{BUCKET}/")
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"someone else's bytes")
    _, result = package_and_upload(s3, model_dir, BUCKET, "p")
    assert result.status is Status.UPDATED
    assert s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] > len(b"someone else's bytes")


def test_existing_archive_and_prefix_are_checked(s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key="m/model.tar.gz", Body=b"x")
    s3.put_object(Bucket=BUCKET, Key="weights/llama/config.json", Body=b"{}")

    data, result = existing_model_data(s3, f"s3://{BUCKET}/m/model.tar.gz")
    assert data.container_fields() == {"ModelDataUrl": f"s3://{BUCKET}/m/model.tar.gz"}
    assert result.status is Status.UNCHANGED

    data, _ = existing_model_data(s3, f"s3://{BUCKET}/weights/llama")
    assert data.container_fields() == {
        "ModelDataSource": {
            "S3DataSource": {
                "S3Uri": f"s3://{BUCKET}/weights/llama/",
                "S3DataType": "S3Prefix",
                "CompressionType": "None",
            }
        }
    }
    with pytest.raises(DeployError, match="not found"):
        existing_model_data(s3, f"s3://{BUCKET}/m/other.tar.gz")
    with pytest.raises(DeployError, match="no objects"):
        existing_model_data(s3, f"s3://{BUCKET}/weights/mistral/")


def test_model_data_round_trips_through_a_container_definition() -> None:
    for uri in ("s3://b/k/model.tar.gz", "s3://b/prefix/"):
        data = ModelData.from_uri(uri)
        assert ModelData.from_container(data.container_fields()) == data
    assert ModelData.from_container({"Image": "x"}) is None
    with pytest.raises(DeployError):
        ModelData.from_uri("https://b/k")


def test_missing_bucket_is_one_deploy_error(clients: Any, model_dir: Path) -> None:
    s3 = clients("s3")  # no bucket created
    with pytest.raises(DeployError, match="missing-bucket"):
        package_and_upload(s3, model_dir, "missing-bucket", "p")


def test_upload_failure_is_one_deploy_error(s3: Any, model_dir: Path) -> None:
    def deny(**_kwargs: Any) -> None:
        from botocore.exceptions import ClientError

        error = {"Code": "AccessDenied", "Message": "not allowed to write"}
        raise ClientError({"Error": error}, "PutObject")

    s3.meta.events.register("before-call.s3.PutObject", deny)
    with pytest.raises(DeployError, match=r"^uploading s3://hearth-models/p/model-.*AccessDenied"):
        package_and_upload(s3, model_dir, BUCKET, "p")
