"""The C attention kernel of the CPU fast path as a backend (kernels/cpu/hearth_cpu.c).

It attends token by token over each token's own sequence (decodes and prefill chunks
take the same path), reading the paged cache in place, so its metadata carries the
per-token fields. Every output depends only on the token's own sequence: results do not
change with batch size, chunking or thread count.

With a ``min_run`` (the gguf-bf16 mode), prefill runs of at least that many tokens of one
sequence take the bfloat16 kernel instead (kernels/cpu/hearth_attention_bf16.c: bfloat16
operands, float32 sums); decodes and shorter runs keep the float32 one, bitwise.

Like the paged backend's CUDA graphs, this backend owns the replay of whole steps: when
every op of the model's forward runs a C kernel, `capture_program` records that forward
once (kernels/cpu/capture.py) and `run` replays it with one C call per step
(kernels/cpu/program.py); otherwise the forward runs eagerly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.layers.linear import Linear
from kernels import LoRAStep
from kernels.cpu import capture, ops
from kernels.cpu.program import StepProgram
from kernels.metadata import AttentionMetadata, SeqSpan

logger = logging.getLogger("hearth.engine")

if TYPE_CHECKING:
    from engine.layers.attention import Attention
    from engine.lora.layer import LinearLoRA


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    token_index = True

    def __init__(self, min_run: int = 0) -> None:
        self.scratch = ops.AttentionScratch()
        self.program: StepProgram | None = None
        self.lora_program: StepProgram | None = None
        """The same forward with every LoRA hook's op (steps with adapter tokens)."""
        self.min_run = min_run
        """Runs of this many tokens of a sequence and more take the bfloat16 kernel (0: none)."""

    def capture_program(self, model: nn.Module, block_size: int) -> StepProgram | None:
        """Record `model`'s forward (bound to its caches) as a step program; None, with
        the reason logged, when some op of it is not a C kernel. With LoRA hooks on its
        linears, a second program with each hook's LoRA op (`lora_program`) runs the
        steps that hold adapter tokens."""
        self.program = self._capture(model, block_size, [])
        hooks = [m.lora for m in model.modules() if isinstance(m, Linear) and m.lora is not None]
        if self.program is not None and hooks:
            self.lora_program = self._capture(model, block_size, hooks)
        return self.program

    def _capture(
        self, model: nn.Module, block_size: int, hooks: list[LinearLoRA]
    ) -> StepProgram | None:
        t = 3  # any count works: every op must cover all of the step's rows
        cpu = torch.device("cpu")
        meta = self.build_metadata([SeqSpan(0, t, [0])], list(range(t)), block_size, cpu)
        ids = torch.zeros(t, dtype=torch.long)
        positions = torch.arange(t, dtype=torch.long)
        assert meta.seq_block_tables is not None and meta.token_seq is not None
        assert meta.token_ctx is not None
        persistent = [*model.parameters(), *model.buffers()]
        for module in model.modules():
            packed = getattr(module, "packed", None)
            persistent += [getattr(packed, "data", None), getattr(packed, "bias", None)]
            blocks = getattr(packed, "blocks", None)  # a tiled weight's float32-kernel copy
            persistent += [getattr(blocks, "data", None)]
            persistent += list(getattr(module, "kv_cache", None) or ())
            experts = getattr(module, "packed_experts", None)  # a MoE layer's table
            persistent += [getattr(experts, "table", None)]
        inputs = {
            "input_ids": ids,
            "positions": positions,
            "slot_mapping": meta.slot_mapping,
            "block_tables": meta.seq_block_tables,
            "token_seq": meta.token_seq,
            "token_ctx": meta.token_ctx,
        }
        if hooks:  # every token on slot 0: each hook records its op, reading lora_slots
            lora_step = LoRAStep.build([0] * t, torch.device("cpu"))
            inputs["lora_slots"] = lora_step.token_slots
            for hook in hooks:
                stack = hook.stack
                persistent += [stack.lora_a, stack.lora_b, stack.scales, stack.row_shard]
            hooks[0].context.step = lora_step
        recorder = capture.Recorder(
            t,
            capture.persistent_ranges(p for p in persistent if isinstance(p, torch.Tensor)),
            {name: tensor.data_ptr() for name, tensor in inputs.items()},
        )
        what = "CPU step program with LoRA" if hooks else "CPU step program"
        try:
            with torch.inference_mode(), capture.recording(recorder):
                result = model(ids, positions, meta)
            return StepProgram(recorder, result)
        except capture.CaptureError as exc:
            logger.warning("%s not captured (%s): the forward runs op by op", what, exc)
            return None
        finally:
            if hooks:
                hooks[0].context.step = None

    @property
    def num_program_ops(self) -> int:
        return self.program.num_ops if self.program is not None else 0

    def run_program(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The captured forward for this step (`capture_program` must have succeeded);
        with `lora_slots` (each token's adapter slot), the LoRA program's."""
        program = self.program if lora_slots is None else self.lora_program
        assert program is not None
        assert meta.seq_block_tables is not None and meta.token_seq is not None
        assert meta.token_ctx is not None
        return program.run(
            input_ids, positions, meta.slot_mapping, meta.seq_block_tables, meta.token_seq,
            meta.token_ctx, meta.max_ctx, meta.block_size, self.scratch, lora_slots,
        )  # fmt: skip

    @staticmethod
    def supported(
        head_dim: int, dtype: torch.dtype, device: torch.device, sinks: bool = False
    ) -> str | None:
        """None when the kernel can run, else why not. `sinks`: the model's attention has
        sinks (gpt-oss), a softmax term the C kernel does not compute."""
        if sinks:
            return "the model's attention has sinks (gpt-oss), which the C kernel lacks"
        if device.type != "cpu" or dtype != torch.float32:
            return "the C attention kernel computes in float32 on the CPU"
        if head_dim % 32:
            return f"head_dim {head_dim} is not a multiple of 32"
        if not ops.available():
            return "no AVX2 on this host"
        return None

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert layer.kv_cache is not None
        assert meta.seq_block_tables is not None and meta.token_seq is not None
        assert meta.token_ctx is not None
        if layer.sinks is not None:  # choose_backends never pairs the two: a guard
            raise ValueError("the C attention kernel has no attention sinks (gpt-oss)")
        k_cache, v_cache = layer.kv_cache
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.stride(2) != 1 or (layer.num_heads > 1 and q.stride(1) != layer.head_dim):
            q = q.contiguous()
        rows = (
            q.view(q.shape[0], -1)
            if q.is_contiguous()
            else q.as_strided((q.shape[0], layer.num_heads * layer.head_dim), (q.stride(0), 1))
        )  # [T, nh*hd] rows with the query's row stride
        return ops.paged_attention(
            rows, layer.num_heads, layer.num_kv_heads, layer.head_dim, k_cache, v_cache,
            meta.seq_block_tables, meta.token_seq, meta.token_ctx, meta.max_ctx, layer.scale,
            self.scratch, sliding_window=layer.sliding_window, min_run=self.min_run,
        )  # fmt: skip
