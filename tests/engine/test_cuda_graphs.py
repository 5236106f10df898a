"""CUDA-graph decode logic on the CPU: buckets, padding, persistent buffers, the replay
decision, and a replayed step equal to the eager one (``EagerCapture`` stands in for the
CUDA graph; the capture itself is exercised by the device check)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import PagedAttentionBackend
from engine.cuda_graphs import (
    PAD_SEQ_LEN,
    PAD_SLOT,
    VLLM_CAPTURE_SIZES,
    CudaGraphRunner,
    DecodeBuffers,
    EagerCapture,
    build_cuda_graphs,
    capture_sizes,
    decode_metadata,
    fill_decode_inputs,
    pick_bucket,
)
from engine.gpu_memory import auto_dtype, kv_cache_budget_bytes, profile_peak_step_bytes
from engine.layers.attention import bind_attention
from kernels import AttentionMetadata
from kernels.metadata import SeqSpan


def test_capture_sizes_follow_vllm_and_cover_max_num_seqs() -> None:
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16]
    assert capture_sizes(256)[-1] == 256 and len(capture_sizes(256)) == 35
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # 17..20 still replay (in 24)
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096) == list(VLLM_CAPTURE_SIZES)  # past 512: eager


def test_pick_bucket() -> None:
    sizes = capture_sizes(64)
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [
        1, 2, 4, 8, 8, 16, 64, 64,
    ]  # fmt: skip
    assert pick_bucket(0, sizes) is None
    assert pick_bucket(65, sizes) is None


def test_fill_pads_rows_and_clears_stale_table_entries() -> None:
    bufs = DecodeBuffers.allocate(8, 4, "cpu")
    fill_decode_inputs(bufs, 8, [5] * 8, [40] * 8, [7] * 8, [[1, 2, 3]] * 8)  # stale step
    used = fill_decode_inputs(
        bufs, 4, [11, 12, 13], [0, 17, 33], [3, 40, 90], [[9], [4, 2], [6, 5, 1]]
    )
    assert used == 3
    assert bufs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert bufs.positions[:4].tolist() == [0, 17, 33, 0]
    assert bufs.slot_mapping[:4].tolist() == [3, 40, 90, PAD_SLOT]
    assert bufs.seq_lens[:4].tolist() == [1, 18, 34, PAD_SEQ_LEN]
    assert bufs.staged(4, 3).tolist() == [[9, 0, 0], [4, 2, 0], [6, 5, 1], [0, 0, 0]]
    dev = DecodeBuffers.allocate(8, 4, "cpu")
    dev.block_tables.fill_(77)  # stale ids past the columns in use stay: never read
    dev.copy_from(bufs, 4, used)
    assert dev.block_tables[:4].tolist() == [
        [9, 0, 0, 77], [4, 2, 0, 77], [6, 5, 1, 77], [0, 0, 0, 77],
    ]  # fmt: skip
    assert dev.seq_lens[:4].tolist() == [1, 18, 34, PAD_SEQ_LEN]
    with pytest.raises(AssertionError):
        fill_decode_inputs(bufs, 2, [1, 2, 3], [0, 0, 0], [0, 0, 0], [[0]] * 3)
    with pytest.raises(AssertionError):  # wider than max_model_len allows
        fill_decode_inputs(bufs, 1, [1], [0], [0], [[0] * 5])


def test_decode_metadata_views_the_buffers() -> None:
    bufs = DecodeBuffers.allocate(8, 4, "cpu")
    meta = decode_metadata(bufs, 4, block_size=16, max_model_len=64)
    assert meta.num_decode_tokens == 4 and meta.num_prefills == 0
    assert meta.decode_max_seq_len == 64  # fixed: capture and replay choose the same kernels
    assert meta.decode_seq_lens.data_ptr() == bufs.seq_lens.data_ptr()
    assert meta.decode_block_tables.shape == (4, 4)


def test_graphs_only_on_cuda_without_enforce_eager() -> None:
    cpu = torch.device("cpu")
    assert build_cuda_graphs(None, [], 16, 64, 8, cpu, enforce_eager=False) is None
    assert build_cuda_graphs(None, [], 16, 64, 8, torch.device("cuda"), enforce_eager=True) is None


def test_auto_dtype_and_kv_budget() -> None:
    assert auto_dtype("cpu", True) == torch.float32
    assert auto_dtype("cuda", True) == torch.bfloat16
    assert auto_dtype("cuda", False) == torch.float16
    gib = 1 << 30
    # 140 GiB card, 3 GiB used (weights + context), a 2 GiB peak step, 0.9, 1 GiB reserve.
    budget = kv_cache_budget_bytes(140 * gib, 137 * gib, 2 * gib, 0.9, gib)
    assert budget == int(140 * gib * 0.9) - 3 * gib - 2 * gib - gib


def _tiny_model() -> torch.nn.Module:
    from transformers import LlamaConfig

    from engine.models.llama import LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=97,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def _kv(
    model: torch.nn.Module, num_blocks: int, bs: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, bs, model.num_kv_heads, model.head_dim)
    kv = [(torch.randn(shape), torch.randn(shape)) for _ in range(model.num_layers)]
    bind_attention(model, kv, PagedAttentionBackend(torch.float32))
    return kv


def _backend(model: torch.nn.Module) -> PagedAttentionBackend:
    """The backend the model's attention layers were bound to."""
    from engine.layers.attention import Attention

    layer = next(m for m in model.modules() if isinstance(m, Attention))
    assert isinstance(layer.backend, PagedAttentionBackend)
    return layer.backend


@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_replayed_decode_equals_eager(num_seqs: int) -> None:
    model, bs = _tiny_model(), 4
    kv = _kv(model, 64, bs)
    graphs = CudaGraphRunner(
        model, _backend(model), bs, 64, capture_sizes(8), torch.device("cpu"), EagerCapture()
    )
    with torch.inference_mode():
        graphs.capture_all()
        assert graphs.backend.num_captured == 4  # 1, 2, 4, 8
        # Sequence i: context 5 + 3i, blocks 8i.., its new token at the last position.
        positions = [4 + 3 * i for i in range(num_seqs)]
        blocks = [list(range(8 * i, 8 * i + p // bs + 1)) for i, p in enumerate(positions)]
        slots = [b[p // bs] * bs + p % bs for b, p in zip(blocks, positions, strict=True)]
        ids = [10 + i for i in range(num_seqs)]
        kv_before = [(k.clone(), v.clone()) for k, v in kv]
        got = graphs.run(ids, positions, slots, blocks).clone()
        kv_graph = [(k.clone(), v.clone()) for k, v in kv]
        for (k, v), (k0, v0) in zip(kv, kv_before, strict=True):  # same cache state again
            k.copy_(k0)
            v.copy_(v0)
        meta = _eager_meta(model, positions, slots, blocks, bs)
        want = model(torch.tensor(ids), torch.tensor(positions), meta)
    assert got.shape == (num_seqs, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The real rows wrote their slots as the eager step did; padding rows wrote nothing.
    untouched = torch.ones(64 * bs, dtype=torch.bool)
    untouched[slots] = False
    for (kg, vg), (k, v), (k0, _) in zip(kv_graph, kv, kv_before, strict=True):
        torch.testing.assert_close(kg, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vg, v, atol=1e-5, rtol=1e-5)
        assert torch.equal(kg.flatten(0, 1)[untouched], k0.flatten(0, 1)[untouched])
    assert graphs.num_replays == 1


def _eager_meta(
    model: torch.nn.Module,
    positions: list[int],
    slots: list[int],
    blocks: list[list[int]],
    bs: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """The unpadded decode step as the eager model runner describes it."""
    spans = [SeqSpan(p, 1, b) for p, b in zip(positions, blocks, strict=True)]
    return _backend(model).build_metadata(spans, slots, bs, torch.device(device))


def test_over_the_largest_bucket_runs_eagerly() -> None:
    model = _tiny_model()
    _kv(model, 8, 4)
    graphs = CudaGraphRunner(
        model, _backend(model), 4, 16, [1, 2], torch.device("cpu"), EagerCapture()
    )
    graphs.capture_all()
    assert graphs.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [[0], [0], [0]]) is None
    assert graphs.num_replays == 0


def test_profile_forward_runs_on_cpu() -> None:
    # The same forward the GPU profiles; the CPU has no allocator statistics: 0 bytes.
    model = _tiny_model()
    assert profile_peak_step_bytes(model, 37, 5, 16, torch.float32, torch.device("cpu")) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager_gpu(dtype: torch.dtype) -> None:
    from engine.cuda_graphs import CudaCapture

    cuda = torch.device("cuda")
    model = _tiny_model().to(device=cuda, dtype=dtype)
    bs = 4
    shape = (64, bs, model.num_kv_heads, model.head_dim)
    kv = [
        (torch.randn(shape, device=cuda, dtype=dtype), torch.randn(shape, device=cuda, dtype=dtype))
        for _ in range(model.num_layers)
    ]
    # max_model_len 2048: the captured attention takes the split-KV kernel.
    backend = PagedAttentionBackend(dtype)
    bind_attention(model, kv, backend)
    graphs = CudaGraphRunner(model, backend, bs, 2048, [1, 2, 4], cuda, CudaCapture())
    positions = [4, 40, 200]
    blocks = [list(range(8 * i, 8 * i + p // bs + 1)) for i, p in enumerate(positions)]
    slots = [b[p // bs] * bs + p % bs for b, p in zip(blocks, positions, strict=True)]
    with torch.inference_mode():
        graphs.capture_all()
        want = model(
            torch.tensor([5, 6, 7], device=cuda),
            torch.tensor(positions, device=cuda),
            _eager_meta(model, positions, slots, blocks, bs, cuda),
        ).clone()
        for _ in range(2):  # replays are repeatable: same inputs, same outputs
            got = graphs.run([5, 6, 7], positions, slots, blocks)
            torch.testing.assert_close(
                got, want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2
            )
