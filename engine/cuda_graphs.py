"""CUDA graphs for decode steps: capture once per batch-size bucket, replay every step.

A decode step of a 1B model launches a few hundred small kernels; eagerly, the GPU waits
on Python and the launch queue for most of the step. A captured graph replays them all
with one launch. A graph fixes every tensor address and shape, so:

* the batch is padded up to a bucket (vLLM's list of sizes) and the step's inputs are
  copied into persistent buffers the graph was captured on;
* padding rows write no KV (slot -1) and attend to one key of block 0, so they stay
  finite and touch nothing a real sequence owns; their outputs are dropped;
* block tables are as wide as ``max_model_len`` needs, and attention metadata carries
  ``max_model_len`` as the (host-side) longest context, so kernel choices made from it
  (the split-KV count) are the same at capture and at replay.

Only pure-decode steps replay (every sequence feeds one token); prefill and mixed steps,
and batches over the largest bucket, run eagerly. ``--enforce-eager`` turns graphs off.

Everything that decides or fills is a plain function or takes a ``GraphCapture`` backend,
so the CPU tests run the same code with ``EagerCapture`` standing in for the CUDA graph.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels import AttentionMetadata

logger = logging.getLogger("hearth.engine")

# vLLM's default capture sizes: 1, 2, 4, then every 8 up to 256, every 16 up to 512.
VLLM_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))

PAD_SLOT = -1
"""Slot of a padding row: ``write_kv_cache`` skips negative slots."""
PAD_SEQ_LEN = 1
"""Context of a padding row: one key (block 0, offset 0), so its softmax is finite."""


def capture_sizes(max_num_seqs: int, limit: Sequence[int] = VLLM_CAPTURE_SIZES) -> list[int]:
    """Buckets to capture: the sizes up to ``max_num_seqs``, plus the first one above it,
    so that every batch the scheduler can form has a bucket."""
    assert max_num_seqs >= 1
    sizes = [s for s in limit if s < max_num_seqs]
    above = [s for s in limit if s >= max_num_seqs]
    if above:
        sizes.append(above[0])
    return sizes


def pick_bucket(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if num_seqs >= 1 and i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The persistent tensors every graph reads its inputs from (one set, sliced per bucket)."""

    input_ids: torch.Tensor
    """[max_size] int64."""
    positions: torch.Tensor
    """[max_size] int64."""
    slot_mapping: torch.Tensor
    """[max_size] int64; PAD_SLOT on padding rows."""
    seq_lens: torch.Tensor
    """[max_size] int32; PAD_SEQ_LEN on padding rows."""
    block_tables: torch.Tensor
    """[max_size, max_blocks_per_seq] int32: what the graphs read. Columns past a row's
    context are never read (kernels stop at seq_len), so they may hold stale ids."""
    table_stage: torch.Tensor
    """[max_size * max_blocks_per_seq] int32: one step's table packed as [bucket, used]
    (``staged``), so the host-to-device copy is one contiguous run of the columns in use,
    not ``max_model_len / block_size`` columns per row."""

    @classmethod
    def allocate(
        cls, max_size: int, max_blocks: int, device: torch.device | str, pin: bool = False
    ) -> DecodeBuffers:
        def make(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        bufs = cls(
            input_ids=make(max_size, dtype=torch.int64),
            positions=make(max_size, dtype=torch.int64),
            slot_mapping=make(max_size, dtype=torch.int64),
            seq_lens=make(max_size, dtype=torch.int32),
            block_tables=make(max_size, max_blocks, dtype=torch.int32),
            table_stage=make(max_size * max_blocks, dtype=torch.int32),
        )
        bufs.slot_mapping.fill_(PAD_SLOT)
        bufs.seq_lens.fill_(PAD_SEQ_LEN)
        return bufs

    def staged(self, bucket: int, used: int) -> torch.Tensor:
        """``[bucket, used]`` view of the packed table of the current step."""
        return self.table_stage[: bucket * used].view(bucket, used)

    def copy_from(self, host: DecodeBuffers, bucket: int, used: int) -> None:
        """Upload a step ``fill_decode_inputs`` wrote into ``host`` (non-blocking from
        pinned memory), then unpack its table into the graphs' ``block_tables``."""
        pairs = [
            (self.input_ids, host.input_ids),
            (self.positions, host.positions),
            (self.slot_mapping, host.slot_mapping),
            (self.seq_lens, host.seq_lens),
        ]
        for dst, src in pairs:
            dst[:bucket].copy_(src[:bucket], non_blocking=True)
        self.staged(bucket, used).copy_(host.staged(bucket, used), non_blocking=True)
        self.block_tables[:bucket, :used].copy_(self.staged(bucket, used))


def fill_decode_inputs(
    bufs: DecodeBuffers,
    bucket: int,
    input_ids: Sequence[int],
    positions: Sequence[int],
    slots: Sequence[int],
    block_ids: Sequence[Sequence[int]],
) -> int:
    """Write one decode step into the first ``bucket`` rows of ``bufs`` (host tensors),
    its block table packed into ``bufs.staged(bucket, used)``; returns ``used``, the
    table's columns (the most blocks of any row, at least 1).

    Row i is sequence i (its one new token at ``positions[i]``, context
    ``positions[i] + 1``); rows ``len(input_ids) .. bucket`` become padding.
    """
    n = len(input_ids)
    assert len(positions) == len(slots) == len(block_ids) == n <= bucket
    width = bufs.block_tables.shape[1]
    bufs.input_ids[:n] = torch.as_tensor(input_ids, dtype=torch.int64)
    bufs.positions[:n] = torch.as_tensor(positions, dtype=torch.int64)
    bufs.slot_mapping[:n] = torch.as_tensor(slots, dtype=torch.int64)
    bufs.seq_lens[:n] = bufs.positions[:n].to(torch.int32) + 1
    used = max(1, max((len(ids) for ids in block_ids), default=1))
    assert used <= width, f"{used} blocks exceed the graph's table width {width}"
    table = bufs.staged(bucket, used)
    # PERF: one conversion of the padded rows, not one small tensor per sequence.
    rows = [list(ids) + [0] * (used - len(ids)) for ids in block_ids]
    table[:n] = torch.as_tensor(rows, dtype=torch.int32).reshape(n, used)
    table[n:] = 0
    bufs.input_ids[n:bucket] = 0
    bufs.positions[n:bucket] = 0
    bufs.slot_mapping[n:bucket] = PAD_SLOT
    bufs.seq_lens[n:bucket] = PAD_SEQ_LEN
    return used


def decode_metadata(
    bufs: DecodeBuffers, bucket: int, block_size: int, max_model_len: int
) -> AttentionMetadata:
    """Attention metadata of a ``bucket``-row decode step whose tensors are views of ``bufs``."""
    return AttentionMetadata.for_decode_graph(
        bufs.slot_mapping[:bucket],
        bufs.block_tables[:bucket],
        bufs.seq_lens[:bucket],
        block_size,
        max_model_len,
    )


class GraphCapture(Protocol):
    """Turns a forward closure into a replayable step that returns its output tensor."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]: ...


class CudaCapture:
    """The real backend: one ``torch.cuda.CUDAGraph`` per bucket, all in one memory pool."""

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm-up outside capture: Triton compiles, cuBLAS picks kernels, the allocator
        # settles. A host sync inside capture would raise, so none can hide in the step.
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerCapture:
    """Stand-in for tests on CPU: "replay" runs the closure again on the same buffers."""

    def __init__(self) -> None:
        self.num_captured = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.num_captured += 1
        fn()
        return fn


class CudaGraphRunner:
    """Owns the buffers and one replayable step per bucket; ``run`` is the runner's hook."""

    def __init__(
        self,
        model: Any,
        attention: Any,
        block_size: int,
        max_model_len: int,
        sizes: Sequence[int],
        device: torch.device,
        backend: GraphCapture,
    ) -> None:
        assert sizes and list(sizes) == sorted(sizes), sizes
        self.model = model
        self.attention = attention
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = list(sizes)
        self.backend = backend
        max_blocks = -(-max_model_len // block_size)
        pin = device.type == "cuda"
        self.host = DecodeBuffers.allocate(self.sizes[-1], max_blocks, "cpu", pin=pin)
        self.dev = DecodeBuffers.allocate(self.sizes[-1], max_blocks, device)
        self._copied: torch.cuda.Event | None = None
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self.num_replays = 0

    def capture_all(self) -> float:
        """Capture every bucket, largest first (so smaller ones reuse its pool); seconds."""
        start = time.monotonic()
        for size in reversed(self.sizes):
            meta = decode_metadata(self.dev, size, self.block_size, self.max_model_len)
            self._steps[size] = self.backend.capture(self._forward_fn(size, meta))
        return time.monotonic() - start

    def _forward_fn(self, size: int, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
        ids, pos = self.dev.input_ids[:size], self.dev.positions[:size]

        def forward() -> torch.Tensor:
            # A replay is a new step: the backend prepares the reused metadata again.
            self.attention.prepare(meta, self.block_size)
            return self.model(ids, pos, meta)

        return forward

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor | None:
        """Hidden states ``[n, H]`` of a decode step of n sequences, or None when the step
        has no bucket (the caller then runs it eagerly)."""
        n = len(input_ids)
        bucket = pick_bucket(n, self.sizes)
        if bucket is None or bucket not in self._steps:
            return None
        if self._copied is not None:
            # The last step's non-blocking copy must have left the pinned buffers.
            self._copied.synchronize()
        used = fill_decode_inputs(self.host, bucket, input_ids, positions, slots, block_ids)
        self.dev.copy_from(self.host, bucket, used)
        if self.dev.input_ids.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.num_replays += 1
        return self._steps[bucket]()[:n]


def build_cuda_graphs(
    model: Any,
    attention: Any,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    device: torch.device,
    enforce_eager: bool,
    say: Callable[[str], None] | None = None,
) -> CudaGraphRunner | None:
    """Capture decode graphs on a CUDA device; None on CPU or with ``--enforce-eager``."""
    if enforce_eager or device.type != "cuda":
        return None
    sizes = capture_sizes(max_num_seqs)
    runner = CudaGraphRunner(
        model, attention, block_size, max_model_len, sizes, device, CudaCapture()
    )
    with torch.inference_mode():
        seconds = runner.capture_all()
    (say or logger.info)(f"captured {len(sizes)} decode CUDA graphs in {seconds:.1f} s")
    return runner
