"""Recording the C kernel calls of one forward into a step program (hearth_cpu.c).

While a `Recorder` is active (`recording`), the wrappers of ``kernels.cpu.ops`` and
``kernels.cpu.q8_ops`` do not run their kernel: they append it to the recorder as one op
and hand back an output tensor of the right shape from a tracked buffer. Every operand
becomes either a persistent pointer (a weight, a cache, a table: anything in the
recorder's `persistent` set) or a column offset into one of the tracked row buffers; a
pointer that is neither means the forward computed something outside the C kernels, and
capture fails (`CaptureError`: the caller runs eagerly). Every op must cover the step's
`t` rows, so the program replays for any token count.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

OP_EMBED, OP_RMS_NORM, OP_ADD_RMS_NORM, OP_LINEAR_F32, OP_LINEAR_Q8A = 1, 2, 3, 4, 5
OP_ROPE, OP_KV_WRITE, OP_ATTENTION, OP_SILU_MUL, OP_LINEAR_BF16 = 6, 7, 8, 9, 10
OP_LORA, OP_HEAD_NORM, OP_MOE, OP_GELU_MUL = 11, 12, 13, 14


class CaptureError(RuntimeError):
    """The forward did something the step program cannot replay."""


class HearthOp(ctypes.Structure):
    """One kernel call (mirrors ``hearth_op`` in hearth_cpu.c)."""

    _fields_ = [
        ("code", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("slot", ctypes.c_int64 * 4),
        ("off", ctypes.c_int64 * 4),
        ("ld", ctypes.c_int64 * 4),
        ("ptr", ctypes.c_void_p * 4),
        ("i", ctypes.c_int64 * 4),
        ("f", ctypes.c_float * 2),
        ("aux", ctypes.c_void_p),
        ("aux2", ctypes.c_void_p),
    ]


@dataclass(slots=True)
class Operand:
    buffer: int
    """Index of a tracked buffer, or -1 for a persistent pointer."""
    offset: int = 0
    """Floats from the start of the buffer's row."""
    ld: int = 0
    ptr: int = 0


@dataclass(slots=True)
class RecordedOp:
    code: int
    operands: list[Operand | None]
    ints: tuple[int, ...] = ()
    floats: tuple[float, ...] = ()
    kind: int = 0
    aux: Operand | None = None
    """A second persistent operand (e.g. the fallback weight of a tiled linear)."""
    aux2: Operand | None = None
    """A third (a LoRA op's row shards)."""


@dataclass
class Recorder:
    t: int
    """Rows of the capture step: every op must process exactly this many."""
    persistent: list[tuple[int, int]]
    """Sorted (start, end) byte ranges of tensors that outlive a step."""
    step_inputs: dict[str, int]
    """Data pointers of the step's own tensors (positions, slots, tables, ...)."""
    ops: list[RecordedOp] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    """Floats per row of each tracked buffer."""
    _buffers: list[torch.Tensor] = field(default_factory=list)

    # -- what the wrappers call -------------------------------------------------------
    def new(self, width: int) -> torch.Tensor:
        """A fresh tracked [t, width] float32 buffer (an op's output)."""
        buf = torch.empty((self.t, width), dtype=torch.float32)
        self._buffers.append(buf)
        self.widths.append(width)
        return buf

    def rows(self, t: int) -> None:
        if t != self.t:
            raise CaptureError(f"an op covers {t} rows, not the step's {self.t}")

    def step_input(self, name: str, tensor: torch.Tensor) -> None:
        if self.step_inputs.get(name) != tensor.data_ptr():
            raise CaptureError(f"{name} is not the step's own tensor")

    def operand(self, tensor: torch.Tensor | None) -> Operand | None:
        if tensor is None:
            return None
        ptr = tensor.data_ptr()
        for index, buf in enumerate(self._buffers):
            base = buf.data_ptr()
            if base <= ptr < base + buf.numel() * 4:
                offset = (ptr - base) // 4
                if offset >= self.widths[index] or (
                    tensor.dim() > 1
                    and tensor.shape[0] > 1
                    and (tensor.stride(0) != self.widths[index])
                ):
                    raise CaptureError("an operand is not a column range of a row buffer")
                return Operand(index, offset, self.widths[index])
        i = bisect.bisect_right(self.persistent, (ptr, 1 << 62)) - 1
        if i >= 0 and self.persistent[i][0] <= ptr < self.persistent[i][1]:
            return Operand(-1, 0, tensor.stride(0) if tensor.dim() > 1 else 0, ptr)
        raise CaptureError("an operand was computed outside the C kernels")

    def emit(
        self,
        code: int,
        operands: Iterable[torch.Tensor | None],
        ints=(),
        floats=(),
        kind=0,
        aux: torch.Tensor | None = None,
        aux2: torch.Tensor | None = None,
    ):
        extras = [self.operand(aux), self.operand(aux2)]
        if any(e is not None and e.buffer >= 0 for e in extras):
            raise CaptureError("an auxiliary operand must be persistent")
        operands_ = [self.operand(t) for t in operands]
        self.ops.append(RecordedOp(code, operands_, tuple(ints), tuple(floats), kind, *extras))

    # -- after the forward --------------------------------------------------------------
    def output(self, tensor: torch.Tensor) -> Operand:
        found = self.operand(tensor)
        if found is None or found.buffer < 0:
            raise CaptureError("the forward's result is not a row buffer")
        return found

    def assign_slots(self, keep: int) -> tuple[list[int], list[int]]:
        """Reuse buffers whose last use is over: returns (slot of each buffer, width of each
        slot). Buffer `keep` (the result) is never reused."""
        last: dict[int, int] = {keep: len(self.ops)}
        for n, op in enumerate(self.ops):
            for o in op.operands:
                if o is not None and o.buffer >= 0:
                    last[o.buffer] = max(last.get(o.buffer, n), n)
        slot_of: dict[int, int] = {}
        slot_widths: list[int] = []
        free: dict[int, list[int]] = {}
        for n, op in enumerate(self.ops):
            for o in op.operands:  # first use is the op that writes it (its output)
                if o is not None and o.buffer >= 0 and o.buffer not in slot_of:
                    width = self.widths[o.buffer]
                    pool = free.get(width)
                    if pool:
                        slot_of[o.buffer] = pool.pop()
                    else:
                        slot_of[o.buffer] = len(slot_widths)
                        slot_widths.append(width)
            for o in op.operands:
                if o is not None and o.buffer >= 0 and last[o.buffer] == n:
                    free.setdefault(self.widths[o.buffer], []).append(slot_of[o.buffer])
                    last[o.buffer] = -1  # freed once
        return [slot_of.get(b, -1) for b in range(len(self.widths))], slot_widths


_active: Recorder | None = None


def active() -> Recorder | None:
    """The recorder of the capture in progress, or None (the wrappers run their kernel)."""
    return _active


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    global _active
    if _active is not None:
        raise CaptureError("a capture is already in progress")
    _active = recorder
    try:
        yield recorder
    finally:
        _active = None


def persistent_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Byte ranges of the storages behind `tensors` (views count as their whole storage)."""
    spans = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            spans.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted(spans)
