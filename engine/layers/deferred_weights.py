"""Linear weights and the token table that a GGUF file's blocks will replace, left unread
while loading.

A GGUF model's checkpoint holds every weight in float32 (4 bytes each: dequantized from
the file, `engine/gguf_checkpoint.py`, or a converted directory's safetensors), while the
fast path computes from the file's own blocks (about 0.6 bytes). Loading the float32
linears only to free them once packed made the start-up peak a whole float32 model: 32 GB
for an 8 B GGUF, more than a 24 GiB host has. With deferral the loader copies into each
linear weight only the rows the GGUF source compares with the file (`sample_rows`,
engine/layers/gguf_linear.py); the rest of the fresh allocation is never written, and
untouched pages cost no memory. The float32 token table is left unread the same way: the
fast path gathers from the file's own rows (`gather_table_from_blocks`), matched by the same
sample rows (an 8 B file's table is 0.8 GB of float32 to dequantize or read for nothing).
Whatever is not replaced in the end (a layer the file can't feed, the exact-mode fallback,
a method that reads the dense weight to pack, a table the file's rows can't give) is read
from the checkpoint in full before anything uses it (`fill`, `fill_unpacked`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, non_linear_parameter_ids

__all__ = ["DeferredWeights", "sample_rows"]


def sample_rows(n: int) -> list[int]:
    """The rows of an `n`-row tensor compared with a GGUF file's (first, last, middle)."""
    return sorted({0, 1, 2, 3, n // 3, n // 2 + 1, n - 2, n - 1} & set(range(n)))


@dataclass(frozen=True)
class _Deferred:
    name: str
    """Checkpoint tensor name."""
    param: nn.Parameter
    """Target parameter; holding it (not a view of it) lets a packed layer free its storage."""
    start: int | None
    length: int | None


class DeferredWeights:
    """The linear-weight slices a load left unread (`load_checkpoint` records them), and
    how to read them when they are needed after all."""

    def __init__(self, read: Callable[[str], torch.Tensor], model: nn.Module) -> None:
        self.read = read
        """The whole checkpoint tensor of a name."""
        shared = non_linear_parameter_ids(model)
        self._deferrable = {
            id(m.weight)
            for m in model.modules()
            if isinstance(m, Linear) and m.weight.dim() == 2 and id(m.weight) not in shared
        } | {
            id(m.weight)
            for m in model.modules()
            if isinstance(m, VocabEmbedding) and m.weight.dtype == torch.float32
        }
        self._pending: dict[int, list[_Deferred]] = {}
        """Deferred slices by their parameter's id (a MoE model has tens of thousands of
        expert weights: `fill` looks one up per linear)."""

    def __len__(self) -> int:
        return sum(len(slices) for slices in self._pending.values())

    def wants(self, param: torch.Tensor) -> bool:
        """Whether a checkpoint tensor bound for `param` is left unread (a linear's weight, the
        token table)."""
        return id(param) in self._deferrable

    def record(
        self,
        name: str,
        param: nn.Parameter,
        start: int | None,
        length: int | None,
        tensor: torch.Tensor,
    ) -> None:
        """Leave `tensor` (`engine.model_loader.CheckpointRows`,
        `engine.gguf_checkpoint.GGUFRows`, or a tensor) unread
        into `param` (rows `start : start + length`, or all) but for its `sample_rows`."""
        dst = param if start is None else param.narrow(0, start, length)
        rows = sample_rows(tensor.shape[0])
        dst[rows] = tensor[rows].to(dst.dtype)
        self._pending.setdefault(id(param), []).append(_Deferred(name, param, start, length))

    def fill(self, param: torch.Tensor) -> int:
        """Read every deferred slice of `param` from the checkpoint; returns how many."""
        mine = self._pending.pop(id(param), [])
        if not mine:
            return 0
        with torch.no_grad():
            for d in mine:
                tensor = self.read(d.name)
                dst = d.param if d.start is None else d.param.narrow(0, d.start, d.length)
                dst.copy_(tensor)
        return len(mine)

    def fill_unpacked(self, model: nn.Module) -> int:
        """Read the weights of every linear that was not packed, and the token table unless
        the file's rows replaced it; drop the rest (their storage is freed or about to be).
        Returns how many slices were read."""
        filled = 0
        for module in model.modules():
            unpacked = isinstance(module, Linear) and module.packed is None
            if unpacked or isinstance(module, VocabEmbedding):
                filled += self.fill(module.weight)
        self._pending.clear()
        return filled
