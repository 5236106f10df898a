"""Load a resolved model directory into a native module (runs in the engine core).

`load_model` reads the config, picks the native class from `engine.models.registry` and
streams the safetensors shards into it, or, for a GGUF converted without its weights, the
file's tensors (`engine.gguf_checkpoint`). Finding the directory (and converting a GGUF)
happened before, in `engine.model_resolver`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.gguf_checkpoint import GGUFCheckpoint
from engine.model_config import read_model_config
from engine.model_resolver import ModelNotFoundError, Progress, _stderr_progress

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["checkpoint_dtype", "iter_safetensors", "load_model"]


def _shard_path(model_dir: Path, name: object) -> Path:
    """A shard named by the index, which must be a plain file name inside the model
    directory: `../x` or `/abs/x` would read weights from elsewhere."""
    if (
        not isinstance(name, str)
        or not name
        or name != Path(name).name
        or name in (".", "..")
        or "\\" in name
    ):
        raise ModelNotFoundError(
            f"model.safetensors.index.json in {str(model_dir)!r} names a shard outside the "
            f"model directory: {name!r} (shards must be file names in that directory)"
        )
    # NOTE: a shard that is a symlink is followed: Hugging Face cache snapshots link
    # every file to ../../blobs.
    return model_dir / name


def _safetensors_files(model_dir: Path) -> list[Path]:
    """Shards to read: those named by `model.safetensors.index.json`, else every file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [_shard_path(model_dir, name) for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    return files


def iter_safetensors(
    model_dir: str | Path, unread: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of every shard, one at a time.

    Tensors are memory-mapped CPU tensors; the consumer copies them into its own
    parameters, so peak memory stays at one model plus one tensor. Names in `unread`
    come as `CheckpointRows` instead, whose rows are read only when indexed (valid
    until the iteration moves on).
    """
    from safetensors import safe_open

    for file in _safetensors_files(Path(model_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield (
                    name,
                    CheckpointRows(f.get_slice(name)) if name in unread else f.get_tensor(name),
                )


class SafetensorsCheckpoint:
    """A model directory's safetensors shards, read as `engine.gguf_checkpoint.GGUFCheckpoint`
    reads a GGUF: every tensor in turn (`tensors`), or one by name (`read`)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = model_dir
        self._file_of: dict[str, Path] | None = None

    def tensors(self, unread: Collection[str] = ()) -> Iterator[tuple[str, Any]]:
        return iter_safetensors(self.model_dir, unread)

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` whole (its shard found from the headers, once)."""
        from safetensors import safe_open

        if self._file_of is None:
            self._file_of = {}
            for file in _safetensors_files(Path(self.model_dir)):
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    self._file_of.update(dict.fromkeys(f.keys(), file))
        with safe_open(str(self._file_of[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)


class CheckpointRows:
    """A checkpoint tensor left unread: its shape, and the rows asked for (for
    `engine.layers.deferred_weights.DeferredWeights.record`)."""

    def __init__(self, view: Any) -> None:
        import torch

        self._view = view
        self.shape = torch.Size(view.get_shape())

    def __getitem__(self, rows: list[int]) -> torch.Tensor:
        import torch

        return torch.cat([self._view[r : r + 1] for r in rows])


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The safetensors element type (``BF16``, ``F16``, ``F32``...) of every matrix (and
    stack of them: a checkpoint's stacked experts) in the checkpoint, or None when they
    differ (or there is none). Vectors (norms, biases) are left out: some checkpoints keep
    those in float32 beside bf16 matrices, and they are never held in 16 bits. Only the
    headers are read."""
    from safetensors import SafetensorError, safe_open

    kinds: set[str] = set()
    try:
        for file in _safetensors_files(Path(model_dir)):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    tensor = f.get_slice(name)
                    if len(tensor.get_shape()) >= 2:
                        kinds.add(tensor.get_dtype())
    except (OSError, SafetensorError, ModelNotFoundError):
        return None  # the loader reports what is wrong with the files
    return kinds.pop() if len(kinds) == 1 else None


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    progress: Progress | None = None,
    linear_dtype: torch.dtype | None = None,
    defer_linears: bool = False,
) -> tuple[nn.Module, Any]:
    """Build the native model for `model_dir` and stream its safetensors weights into it.

    Parameters are allocated uninitialised (`torch.empty`) straight on `device` in
    `dtype`: no random init, no meta-device round trip, each checkpoint tensor is
    copied (and cast) exactly once. Returns the model in eval mode and its config
    (`engine.model_config`: config.json's values, or transformers' config object).

    `linear_dtype`: the type linear weights and embedding tables are held in (the
    checkpoint's own 16 bits, `engine/layers/weight_storage.py`), when it is not `dtype`.
    `defer_linears`: leave linear weights unread but for their sample rows, for a GGUF's
    blocks to replace (`model.deferred_weights`, engine/layers/deferred_weights.py).
    """
    import torch

    say = progress or _stderr_progress
    from engine.models.registry import get_model_class

    start = time.monotonic()
    config = read_model_config(model_dir)
    in_gguf = GGUFCheckpoint.of_directory(model_dir)
    checkpoint = in_gguf or SafetensorsCheckpoint(model_dir)
    model_cls = get_model_class(config)
    with torch.no_grad():
        model = model_cls(config, dtype=dtype, device=device)
        held = 0
        if linear_dtype is not None and linear_dtype != dtype:
            from engine.layers.weight_storage import hold_weights_in

            held = hold_weights_in(model, linear_dtype)
        unread: set[str] = set()
        if defer_linears:
            from engine.layers.deferred_weights import DeferredWeights
            from engine.models.weights import weight_targets

            deferred = DeferredWeights(checkpoint.read, model)
            model.deferred_weights = deferred
            unread = {n for n, (p, _, _) in weight_targets(model).items() if deferred.wants(p)}
        model.load_weights(checkpoint.tensors(unread))
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    held_in = f", {held} weights in {str(linear_dtype).removeprefix('torch.')}" if held else ""
    if unread:
        held_in += f", {len(unread)} weights left for the GGUF's blocks"
    origin = f"{model_dir}" if in_gguf is None else f"{in_gguf.path} (config {model_dir})"
    say(
        f"loaded {model_cls.__name__} ({n_params / 1e6:.1f} M params, {dtype}{held_in}, {device}) "
        f"from {origin} in {time.monotonic() - start:.2f} s"
    )
    return model, config
