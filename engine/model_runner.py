"""Turns a scheduled step into one forward pass over a flat batch of tokens.

Everything device-side lives here: the paged KV cache tensors (bound to the model's
attention layers once, with the attention backend), the step's input ids, positions and
slot mapping, the forward, the logits of the rows that sample, and the sampler. The
attention backend builds the step's metadata. Tokens are laid out decodes first
(sequences with one new token), then prefill chunks, as `kernels.AttentionMetadata`
expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import prompt_logprobs
from engine.attention import AttentionBackend, CpuAttentionBackend
from engine.cuda_graphs import CudaGraphRunner
from engine.host_memory import zeros_on_touch
from engine.layers.attention import bind_attention
from engine.lora.manager import LoRAManager
from engine.messages import TokenLogprob
from engine.models.classifier import is_classifier
from engine.pooler import Pooler
from engine.pooling_config import PoolingConfig
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledRequest
from kernels.metadata import SeqSpan
from kernels.reference import kv_head_elems


@dataclass(slots=True)
class StepResult:
    sampled: list[ScheduledRequest]
    """The scheduled sequences that reached their end this step, in `output` row order."""
    output: SamplerOutput | None
    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)
    """Prompt tokens scored this step, per request that asked (engine/prompt_logprobs.py)."""
    embeddings: list[tuple[Request, bytes]] = field(default_factory=list)
    """Embedding requests whose prompt this step completed, with their vector
    (engine/pooler.py)."""


def kv_cache_bytes_per_block(
    model: torch.nn.Module, block_size: int, dtype: torch.dtype, v_dtype: torch.dtype | None = None
) -> int:
    """Bytes of one block of every layer's keys (``dtype``) and values (``v_dtype``, default
    the keys')."""
    total = 0
    for d in (dtype, v_dtype or dtype):
        row = kv_head_elems(model.head_dim, d) * torch.empty((), dtype=d).element_size()
        total += model.num_layers * block_size * model.num_kv_heads * row
    return total


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: list[int],
        attention: AttentionBackend,
        pooling: PoolingConfig | None = None,
        v_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 for int8)]
        if v_dtype is None or v_dtype == kv_dtype:
            row = kv_head_elems(model.head_dim, kv_dtype)
            self._kv = zeros_on_touch(
                (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, row),
                kv_dtype,
                device,
            )
            self.kv_caches = [(self._kv[i, 0], self._kv[i, 1]) for i in range(model.num_layers)]
        else:  # keys and values of different types (float16 keys, int8 values): two pools
            shape = (model.num_layers, num_blocks, block_size, model.num_kv_heads)
            k = zeros_on_touch((*shape, kv_head_elems(model.head_dim, kv_dtype)), kv_dtype, device)
            v = zeros_on_touch((*shape, kv_head_elems(model.head_dim, v_dtype)), v_dtype, device)
            self.kv_caches = [(k[i], v[i]) for i in range(model.num_layers)]
        bind_attention(model, self.kv_caches, attention)
        self.sampler = Sampler(device)
        self.pooler = Pooler(
            pooling or PoolingConfig(), head=model.classify if is_classifier(model) else None
        )
        self.cuda_graphs: CudaGraphRunner | None = None
        """Set by the core after capture (GPU, no --enforce-eager); see engine/cuda_graphs.py."""
        self.lora: LoRAManager | None = None
        """Set by the core with --enable-lora: each step tells it which slot each token uses."""

    def forget(self, request: Request) -> None:
        self.sampler.forget(request.request_id)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepResult:
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        has_lora = self._begin_lora(ordered)
        try:
            return self._execute(ordered, decodes, prefills, has_lora)
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _begin_lora(self, ordered: list[ScheduledRequest]) -> bool:
        """The step's per-token adapter slots (engine/lora/manager.py); True when any
        token uses an adapter."""
        if self.lora is None:
            return False
        token_slots: list[int] = []
        for item in ordered:
            token_slots.extend([item.request.lora_slot] * item.num_new_tokens)
        return self.lora.begin_step(token_slots)

    def _execute(
        self,
        ordered: list[ScheduledRequest],
        decodes: list[ScheduledRequest],
        prefills: list[ScheduledRequest],
        has_lora: bool,
    ) -> StepResult:
        input_ids, positions, slots, logits_rows, sampled = self._flatten(ordered)
        dev = self.device
        hidden = None
        # A step with adapter tokens runs eagerly on CUDA (the captured graphs hold the
        # base model's kernels only); on the CPU fast path it replays the step program
        # captured with the LoRA ops, fed each token's slot (docs/architecture.md, "LoRA").
        # --- CUDA graphs hook: a pure-decode step within the largest bucket replays a
        # captured graph (None otherwise: run eagerly below). See engine/cuda_graphs.py.
        if self.cuda_graphs is not None and not prefills and not has_lora:
            block_ids = [s.request.block_ids for s in decodes]
            hidden = self.cuda_graphs.run(input_ids, positions, slots, block_ids)
        # --- end of the CUDA graphs hook
        if hidden is None:
            spans = [
                SeqSpan(s.request.num_computed_tokens, s.num_new_tokens, s.request.block_ids)
                for s in ordered
            ]
            meta = self.attention.build_metadata(spans, slots, self.block_size, dev)
            ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
            positions_t = torch.tensor(positions, dtype=torch.long, device=dev)
            if (
                isinstance(self.attention, CpuAttentionBackend)
                and self.attention.program
                and (not has_lora or self.attention.lora_program)
            ):
                lora = self.lora.context.step if has_lora and self.lora is not None else None
                lora_slots = lora.token_slots if lora is not None else None
                hidden = self.attention.run_program(ids_t, positions_t, meta, lora_slots)
            else:
                hidden = self.model(ids_t, positions_t, meta)
        # Prompt logprobs: scored from this step's hidden rows, chunk by chunk.
        scored = prompt_logprobs.score_step(self.model, hidden, ordered)
        # Embeddings: pooled from the same rows, chunk by chunk; they never sample.
        embedded = self.pooler.pool_step(hidden, ordered)
        if not sampled:
            return StepResult([], None, scored, embedded)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        output = self.sampler(logits, [s.request for s in sampled], self.eos_token_ids)
        return StepResult(sampled, output, scored, embedded)

    def _flatten(
        self, ordered: list[ScheduledRequest]
    ) -> tuple[list[int], list[int], list[int], list[int], list[ScheduledRequest]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        for item in ordered:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples and request.pooling is None:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(item)
        return input_ids, positions, slots, logits_rows, sampled
