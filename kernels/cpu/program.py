"""A recorded forward replayed by the C interpreter: one ctypes call per engine step.

`StepProgram` turns a `capture.Recorder` (the model's own forward, recorded once) into the
``hearth_op`` array of hearth_cpu.c and runs it for any token count: each step gets
row buffers of its own size (reused between steps), the step's ids, positions, slots and
attention tables, and scratch. The kernels and their arguments are exactly those of the
eager forward, so the result is bitwise the eager one (tests/engine/test_step_program.py).
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import capture, ops, q8_ops

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class HearthStep(ctypes.Structure):
    """One step's inputs (mirrors ``hearth_step`` in hearth_cpu.c)."""

    _fields_ = [
        ("t", _i64),
        ("bufs", _ptr),
        ("ids", _ptr),
        ("positions", _ptr),
        ("slots", _ptr),
        ("tables", _ptr),
        ("seq", _ptr),
        ("ctx", _ptr),
        ("max_blocks", _i64),
        ("block_size", _i64),
        ("att_scratch", _ptr),
        ("att_per_thread", _i64),
        ("q8_scratch", _ptr),
        ("amx_min_t", _i64),
        ("lora_slots", _ptr),
        ("lora_scratch", _ptr),
        ("moe_scratch", _ptr),
        ("moe_order", _ptr),
    ]


class StepProgram:
    """The recorded kernel calls of one forward, replayable for any number of tokens."""

    def __init__(self, recorder: capture.Recorder, result: torch.Tensor) -> None:
        out = recorder.output(result)
        slot_of, self.slot_widths = recorder.assign_slots(out.buffer)
        self.out_slot, self.out_offset = slot_of[out.buffer], out.offset
        self.out_width = result.shape[-1]
        self.num_ops = len(recorder.ops)
        self.ops = (capture.HearthOp * self.num_ops)()
        self.q8_k = 0
        self.lora_width = 0
        """Floats per token of the widest LoRA op's scratch (0: the program holds none)."""
        self.moe_width = self.moe_top_k = 0
        """Floats per token of the widest MoE op's scratch, and the most experts a token
        takes (its routing order: 2 x top_k int64 per token)."""
        for op, rec in zip(self.ops, recorder.ops, strict=True):
            op.code, op.kind = rec.code, rec.kind
            for j, operand in enumerate(rec.operands):
                if operand is None:
                    op.slot[j], op.ptr[j] = -1, None
                elif operand.buffer < 0:
                    op.slot[j], op.ptr[j], op.ld[j] = -1, operand.ptr, operand.ld
                else:
                    op.slot[j] = slot_of[operand.buffer]
                    op.off[j], op.ld[j] = operand.offset, operand.ld
            op.aux = rec.aux.ptr if rec.aux is not None else None
            op.aux2 = rec.aux2.ptr if rec.aux2 is not None else None
            for j, v in enumerate(rec.ints):
                op.i[j] = v
            for j, v in enumerate(rec.floats):
                op.f[j] = v
            if rec.code == capture.OP_LINEAR_Q8A:
                self.q8_k = max(self.q8_k, rec.ints[0])
            if rec.code == capture.OP_LORA:  # h: shards x max_rank floats per token
                self.lora_width = max(self.lora_width, rec.ints[2] * rec.ints[3])
            if rec.code == capture.OP_MOE:  # top_k x (2 h + 3 inter + 1) floats per token
                self.moe_width = max(self.moe_width, rec.ints[2])
                self.moe_top_k = max(self.moe_top_k, rec.ints[0])
        self._arena = torch.empty(0, dtype=torch.float32)
        self._bufs = (ctypes.c_void_p * max(len(self.slot_widths), 1))()
        self._q8 = torch.empty(0, dtype=torch.uint8)
        self._lora_h = torch.empty(0, dtype=torch.float32)
        self._moe = torch.empty(0, dtype=torch.float32)
        self._moe_order = torch.empty(0, dtype=torch.int64)

    @property
    def floats_per_row(self) -> int:
        return sum(self.slot_widths)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        token_seq: torch.Tensor,
        token_ctx: torch.Tensor,
        max_ctx: int,
        block_size: int,
        scratch: ops.AttentionScratch,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward's result ``[T, width]`` for this step (a view of the program's row
        buffers: valid until the next `run`). `lora_slots` (int32 ``[T]``, -1: the base)
        feeds the program's LoRA ops; None skips them."""
        t = input_ids.shape[0]
        need = t * self.floats_per_row
        if self._arena.numel() < need:
            self._arena = torch.empty(max(need, 2 * self._arena.numel()), dtype=torch.float32)
        base, at = self._arena.data_ptr(), 0
        views = []
        for slot, width in enumerate(self.slot_widths):
            self._bufs[slot] = base + 4 * at
            views.append((at, width))
            at += t * width
        step = HearthStep()
        step.t = t
        step.bufs = ctypes.cast(self._bufs, ctypes.c_void_p)
        step.ids, step.positions = input_ids.data_ptr(), positions.data_ptr()
        step.slots = slot_mapping.data_ptr()
        step.tables, step.seq, step.ctx = (
            block_tables.data_ptr(),
            token_seq.data_ptr(),
            token_ctx.data_ptr(),
        )
        step.max_blocks, step.block_size = block_tables.shape[1], block_size
        att = scratch.get(max_ctx)
        step.att_scratch, step.att_per_thread = att.data_ptr(), scratch.per_thread
        if self.q8_k:
            nbytes = q8_ops.scratch_bytes(t, self.q8_k) + 64
            if self._q8.numel() < nbytes:
                self._q8 = torch.empty(max(nbytes, 2 * self._q8.numel()), dtype=torch.uint8)
            step.q8_scratch = (self._q8.data_ptr() + 63) & ~63
        step.amx_min_t = q8_ops.AMX_AUTO
        if lora_slots is not None and self.lora_width:
            if lora_slots.dtype != torch.int32 or lora_slots.shape != (t,):
                raise ValueError(f"lora_slots must be int32 [{t}]")
            if self._lora_h.numel() < t * self.lora_width:
                self._lora_h = torch.empty(t * self.lora_width, dtype=torch.float32)
            step.lora_slots, step.lora_scratch = lora_slots.data_ptr(), self._lora_h.data_ptr()
        if self.moe_width:
            if self._moe.numel() < t * self.moe_width:
                self._moe = torch.empty(t * self.moe_width, dtype=torch.float32)
                self._moe_order = torch.empty(2 * t * self.moe_top_k, dtype=torch.int64)
            step.moe_scratch, step.moe_order = self._moe.data_ptr(), self._moe_order.data_ptr()
        ops.library().hearth_run_program(self.ops, self.num_ops, ctypes.byref(step))
        start, width = views[self.out_slot]
        rows = self._arena[start : start + t * width].view(t, width)
        return rows[:, self.out_offset : self.out_offset + self.out_width]
