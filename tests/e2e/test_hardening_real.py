"""Issue 17 on a real server: a `--uds` socket is not open to every local user (item 6),
and `/metrics` needs the key when one is set and does not name the model's path in its
labels (item 9)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_a_uds_socket_is_0660_and_metrics_need_the_key_and_hide_the_path(
    tmp_path: Path, model_smollm2_dir: str
) -> None:
    sock = tmp_path / "hearth.sock"
    log = tmp_path / "uds.log"
    model = model_smollm2_dir.rstrip("/")
    cmd = [sys.executable, "-m", "container.cli", "serve", model, "--uds", str(sock)]
    cmd += ["--api-key", "s3cret", "--max-model-len", "512", "--kv-cache-memory", "128MiB"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=10)
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if client.get("http://hearth/ping").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        mode = stat.S_IMODE(os.stat(sock).st_mode)
        # gunicorn's default umask 0 made it 0777: any local user reached the API.
        assert mode & 0o007 == 0, oct(mode)
        assert mode == 0o660, oct(mode)
        assert client.get("http://hearth/metrics").status_code == 401
        keyed = client.get("http://hearth/metrics", headers={"Authorization": "Bearer s3cret"})
        assert keyed.status_code == 200 and "hearth:" in keyed.text
        # No --served-model-name: the series were labelled with the model's path.
        assert f'model_name="{Path(model).name}"' in keyed.text, keyed.text[-2000:]
        assert model not in keyed.text
        # /v1/models keeps vLLM's default name, the --model argument: clients send it.
        listed = client.get("http://hearth/v1/models", headers={"x-api-key": "s3cret"})
        assert [card["id"] for card in listed.json()["data"]] == [model]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
