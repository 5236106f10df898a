"""Turns a scheduled step into one forward pass over a flat batch of tokens.

Everything device-side lives here: the paged KV cache tensors, the step's input ids,
positions, slot mapping and attention metadata, the forward, the logits of the rows
that sample, and the sampler. Tokens are laid out decodes first (sequences with one
new token), then prefill chunks, as `kernels.AttentionMetadata` expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import prompt_logprobs
from engine.cuda_graphs import CudaGraphRunner
from engine.messages import TokenLogprob
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledRequest
from kernels import AttentionMetadata


@dataclass(slots=True)
class StepResult:
    sampled: list[ScheduledRequest]
    """The scheduled sequences that reached their end this step, in `output` row order."""
    output: SamplerOutput | None
    prompt_logprobs: list[tuple[Request, list[TokenLogprob]]] = field(default_factory=list)
    """Prompt tokens scored this step, per request that asked (engine/prompt_logprobs.py)."""


def kv_cache_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


def zeros_on_touch(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor whose CPU memory is committed only as it is written.

    On CPU the pool comes from calloc (numpy.zeros): for a large pool the C library maps
    fresh zero pages and never writes them, so a 4 GiB KV cache costs RAM only for the
    blocks in use. `torch.zeros` would write (and commit) every byte at start-up.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    item = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros((*shape[:-1], shape[-1] * item), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: list[int],
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self._kv = zeros_on_touch(
            (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim),
            dtype,
            device,
        )
        self.kv_caches = [(self._kv[i, 0], self._kv[i, 1]) for i in range(model.num_layers)]
        self.sampler = Sampler(device)
        self.cuda_graphs: CudaGraphRunner | None = None
        """Set by the core after capture (GPU, no --enforce-eager); see engine/cuda_graphs.py."""

    def forget(self, request: Request) -> None:
        self.sampler.forget(request.request_id)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepResult:
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, slots, logits_rows, sampled = self._flatten(ordered)
        dev = self.device
        hidden = None
        # --- CUDA graphs hook: a pure-decode step within the largest bucket replays a
        # captured graph (None otherwise: run eagerly below). See engine/cuda_graphs.py.
        if self.cuda_graphs is not None and not prefills:
            block_ids = [s.request.block_ids for s in decodes]
            hidden = self.cuda_graphs.run(input_ids, positions, slots, block_ids)
        # --- end of the CUDA graphs hook
        if hidden is None:
            meta = self._metadata(decodes, prefills, slots)
            positions_t = torch.tensor(positions, dtype=torch.long, device=dev)
            if getattr(self.model, "native", None) is not None:
                self._add_token_metadata(meta, ordered, positions_t)
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=dev),
                positions_t,
                self.kv_caches,
                meta,
            )
        # Prompt logprobs: scored from this step's hidden rows, chunk by chunk.
        scored = prompt_logprobs.score_step(self.model, hidden, ordered)
        if not sampled:
            return StepResult([], None, scored)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        output = self.sampler(logits, [s.request for s in sampled], self.eos_token_ids)
        return StepResult(sampled, output, scored)

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
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(item)
        return input_ids, positions, slots, logits_rows, sampled

    def _add_token_metadata(
        self, meta: AttentionMetadata, ordered: list[ScheduledRequest], positions: torch.Tensor
    ) -> None:
        """Per-token sequence rows and context lengths for kernels that attend token by token."""
        counts = torch.tensor([s.num_new_tokens for s in ordered], dtype=torch.long)
        meta.seq_block_tables = self._block_table(ordered)
        meta.token_seq = torch.repeat_interleave(
            torch.arange(len(ordered), dtype=torch.int32), counts
        )
        meta.token_ctx = (positions + 1).to(torch.int32)
        meta.max_ctx = max(
            (s.request.num_computed_tokens + s.num_new_tokens for s in ordered), default=0
        )

    def _block_table(self, items: list[ScheduledRequest]) -> torch.Tensor:
        width = max((len(s.request.block_ids) for s in items), default=0)
        rows = [s.request.block_ids + [0] * (width - len(s.request.block_ids)) for s in items]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(items), width)

    def _metadata(
        self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest], slots: list[int]
    ) -> AttentionMetadata:
        dev = self.device
        decode_lens = [s.request.num_computed_tokens + 1 for s in decodes]
        prefill_lens = [s.request.num_computed_tokens + s.num_new_tokens for s in prefills]
        query_lens = [s.num_new_tokens for s in prefills]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_size=self.block_size,
            num_decode_tokens=len(decodes),
            decode_block_tables=self._block_table(decodes),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=dev),
            decode_max_seq_len=max(decode_lens, default=0),
            num_prefills=len(prefills),
            prefill_query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            prefill_block_tables=self._block_table(prefills),
            prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=dev),
            prefill_max_query_len=max(query_lens, default=0),
            prefill_max_seq_len=max(prefill_lens, default=0),
        )
