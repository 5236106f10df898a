"""A model that ships as safetensors alone on the CPU fast path: its own weights in 16 bits.

The contract (engine/layers/half_weights.py): a weight every value of which is a bfloat16
(a bf16 checkpoint loaded in float32) or a float16 is handed to the kernels in that kind,
bit for bit, so the engine computes the exact model's function up to the order of float32
sums; a float32 weight is rounded once to float16 and the loaded weight becomes the rounded
one, so the engine computes what it computes for the same checkpoint saved in float16.
`--quantization auto` serves such a model this way, `--dtype float32` keeps it exact, and
`--quantization q8_0` is the Q8_0-at-load mode (tests/engine/test_q8_0_weights.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.layers.half_weights import HalfWeights, half_rows
from engine.layers.linear import Linear, Shard
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams
from tests.engine.engine_runs import assert_same_packing, blocks_core, greedy_runs
from tests.engine.tiny_models import COMMON, CONFIGS, SERVED_VOCAB
from tests.engine.tiny_models import save_random_config as _save_weights
from tests.handlers.handlers_testing import build_tiny_model

ops = pytest.importorskip("kernels.cpu.ops")
needs_avx2 = pytest.mark.skipif(
    not ops.available(), reason="host has no AVX2: the C kernels do not run here"
)

VOCAB = SERVED_VOCAB
"""The handler tests' tokenizer (400 ids) fits; a multiple of the kernels' row group."""
NEW_TOKENS = 8


def _llama() -> LlamaConfig:
    # head_dim 32: the C attention kernel takes multiples of 32.
    return LlamaConfig(**{**COMMON, "vocab_size": VOCAB}, head_dim=32, tie_word_embeddings=True)


def _qwen3_untied() -> Qwen3Config:
    return Qwen3Config(
        **{**COMMON, "vocab_size": VOCAB}, head_dim=32, tie_word_embeddings=False,
        attention_bias=True,
    )  # fmt: skip


def _linear(weight: torch.Tensor) -> Linear:
    rows, cols = weight.shape
    layer = Linear(
        cols, rows, [Shard("model.layers.0.mlp.down_proj", rows)], bias=False,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def test_each_weight_takes_the_16_bit_kind_that_holds_it_exactly() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=gen) * 0.05
    as_bf16 = w.to(torch.bfloat16).float()
    as_f16 = w.to(torch.float16).float()  # not all bfloat16 values (10 mantissa bits)
    assert not torch.equal(as_f16.to(torch.bfloat16).float(), as_f16)
    kind, half, exact = half_rows(as_bf16, rounding=False)
    assert kind == "bf16" and exact and torch.equal(half.view(torch.bfloat16).float(), as_bf16)
    kind, half, exact = half_rows(as_f16, rounding=False)
    assert kind == "f16" and exact and torch.equal(half.view(torch.float16).float(), as_f16)
    assert half_rows(w, rounding=False) is None  # float32 values: neither holds them
    kind, half, exact = half_rows(w, rounding=True)
    assert kind == "f16" and not exact
    assert torch.equal(half.view(torch.float16), w.to(torch.float16))
    big = w.clone()
    big[3, 5] = 1e5  # past float16's range: bfloat16 rounding instead of inf
    kind, half, exact = half_rows(big, rounding=True)
    assert kind == "bf16" and not exact
    assert torch.equal(half.view(torch.bfloat16), big.to(torch.bfloat16))
    negative = -as_bf16.abs()  # sign bits: the top half taken as it is
    kind, half, _ = half_rows(negative, rounding=False)
    assert kind == "bf16" and torch.equal(half.view(torch.bfloat16).float(), negative)


def test_rows_replace_only_a_rounded_weight_and_skip_shapes_the_kernels_cant_take() -> None:
    gen = torch.Generator().manual_seed(4)
    exact = (torch.randn(16, 64, generator=gen) * 0.05).to(torch.bfloat16).float()
    layer = _linear(exact)
    source = HalfWeights(rounding=True)
    laid = source.rows(layer, row_multiple=8)
    assert laid.kind == "bf16" and laid.joined().shape == (16, 128) and source.rounded == 0
    assert torch.equal(layer.weight.detach(), exact)
    w = torch.randn(16, 64, generator=gen) * 0.05
    layer = _linear(w)
    assert source.rows(layer, row_multiple=8).kind == "f16" and source.rounded == 1
    assert torch.equal(layer.weight.detach(), w.to(torch.float16).float())
    assert source.describe().endswith(", 1 rounded to float16")
    assert HalfWeights(rounding=False).rows(_linear(w), row_multiple=8) is None
    for rows_, cols in ((16, 48), (2, 64)):  # columns not whole blocks; a two-label head
        layer = _linear(torch.randn(rows_, cols, generator=gen))
        before = layer.weight.detach().clone()
        assert source.rows(layer, row_multiple=8) is None
        assert torch.equal(layer.weight.detach(), before)


def save_random_config(config, directory: Path) -> None:
    """Random weights of `config` plus the handler tests' tokenizer files."""
    build_tiny_model(directory)
    _save_weights(config, directory)


def _save_in(
    directory: Path,
    dtype: torch.dtype,
    matrices_only: bool = False,
    stored: torch.dtype | None = None,
) -> None:
    """Rewrite the checkpoint in `directory` with every tensor (every matrix: the linear
    and embedding weights, not the norms) rounded to `dtype`, stored as `dtype` (or as
    `stored`: float32 values that `dtype` holds exactly)."""
    path = directory / "model.safetensors"
    tensors = {
        k: (
            v.to(dtype).to(stored or dtype) if v.dim() == 2 or not matrices_only else v
        ).contiguous()
        for k, v in load_file(path).items()
    }
    save_file(tensors, path, metadata={"format": "pt"})


def _core(model_dir: Path, **overrides) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), max_model_len=64, **overrides))


def _fast_core(model_dir: Path, **overrides) -> EngineCore:
    """`blocks_core` of the checkpoint, checking that `auto` runs its 16-bit weights."""
    fast = blocks_core(functools.partial(_core, model_dir), **overrides)
    assert "16-bit weights" in fast.backends.description
    return fast


def _run(core: EngineCore, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return greedy_runs(core, prompts, NEW_TOKENS)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 33)]


def _packed_kinds(core: EngineCore) -> set[str]:
    linears = [m for m in core.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in linears)
    return {m.packed.kind for m in linears}


@needs_avx2
@pytest.mark.parametrize("config", [_llama, _qwen3_untied], ids=["llama", "qwen3"])
def test_a_bf16_checkpoint_runs_its_own_weights_on_the_kernels_by_default(
    config, tmp_path: Path
) -> None:
    """auto: every linear packed as bfloat16 (nothing rounded); on those blocks with
    float32 activations (`gguf`, auto's mode where no bfloat16 kernel runs) greedy tokens
    are transformers' float32 ones and the logprobs within float32 sum-order error of the
    exact mode's; --dtype float32 stays on the exact torch path."""
    save_random_config(config(), tmp_path)
    _save_in(tmp_path, torch.bfloat16)
    fast = _fast_core(tmp_path, kv_cache_dtype="float32")
    assert fast.backends.quantization == "gguf"
    assert "rounded" not in fast.backends.description
    assert _packed_kinds(fast) == {"bf16"}
    exact = _core(tmp_path, dtype="float32")
    assert exact.backends.quantization == "none"
    prompts = _prompts()
    got, want = _run(fast, prompts), _run(exact, prompts)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for ids, (tokens, logprobs), (exact_tokens, exact_logprobs) in zip(
        prompts, got, want, strict=True
    ):
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            min_new_tokens=NEW_TOKENS,
        )
        assert tokens == exact_tokens == out[0, len(ids) :].tolist()
        assert max(abs(a - b) for a, b in zip(logprobs, exact_logprobs, strict=True)) < 1e-4


@needs_avx2
def test_a_float32_checkpoint_computes_what_its_float16_copy_computes(tmp_path: Path) -> None:
    """auto on float32 weights rounds them once to float16: the same packed bits, tokens
    and logprobs as the checkpoint with its matrices saved in float16 (exact in f16, norms
    float32 in both); not the exact mode's logprobs."""
    save_random_config(_llama(), tmp_path / "f32")
    save_random_config(_llama(), tmp_path / "f16")
    _save_in(tmp_path / "f16", torch.float16, matrices_only=True)
    rounded, saved = _core(tmp_path / "f32"), _core(tmp_path / "f16")
    assert "rounded to float16" in rounded.backends.description
    assert "rounded" not in saved.backends.description
    assert _packed_kinds(rounded) == _packed_kinds(saved) == {"f16"}
    assert_same_packing(rounded, saved)
    prompts = _prompts()
    got = _run(rounded, prompts)
    assert got == _run(saved, prompts)
    exact = _core(tmp_path / "f32", quantization="none")
    assert [lp for _, lp in _run(exact, prompts)] != [lp for _, lp in got]


def _bf16_kernels() -> bool:
    from kernels.cpu import bf16_ops

    return ops.available() and bf16_ops.available()


@pytest.mark.skipif(not _bf16_kernels(), reason="needs AMX-BF16 or AVX512-BF16 (gguf-bf16)")
def test_where_bfloat16_kernels_run_auto_tiles_the_checkpoints_own_weights(tmp_path: Path) -> None:
    """auto is gguf-bf16 there: each linear's tiles hold the bf16 checkpoint's weights (the
    16-bit blocks serve calls under the threshold), and a prompt's first-token logprob stays
    within bfloat16 activation rounding of the exact mode's."""
    from kernels.cpu import bf16_ops

    save_random_config(_llama(), tmp_path)
    _save_in(tmp_path, torch.bfloat16)
    tiled = _core(tmp_path)
    assert tiled.backends.quantization == "gguf-bf16"
    linears = [m for m in tiled.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.packed, bf16_ops.TiledWeight) for m in linears)
    assert {m.packed.blocks.kind for m in linears} == {"bf16"}
    exact = _core(tmp_path, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    firsts = []
    for core in (tiled, exact):
        for i, ids in enumerate(_prompts()):
            core.add_request(AddRequest(request_id=f"p{i}", prompt_token_ids=ids, params=params))
        got: dict[str, float] = {}
        while core.has_work():
            for _, out in core.step():
                for lp in out.new_logprobs or []:
                    got[out.request_id] = lp.logprob
        firsts.append([got[f"p{i}"] for i in range(3)])
    assert max(abs(a - b) for a, b in zip(*firsts, strict=True)) < 0.05


@needs_avx2
@pytest.mark.parametrize(("qtype", "dtype"), [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_a_16_bit_gguf_runs_its_tensors_as_stored(qtype: str, dtype, tmp_path: Path) -> None:
    """A GGUF whose weights are F16 / BF16 tensors (llama.cpp's ``--outtype f16`` / ``bf16``)
    packs the file's own rows: the same packed bits, tokens and logprobs as the same
    checkpoint served from safetensors in that dtype."""
    from engine.model_resolver import resolve_model_dir
    from tests.engine.gguf_writer import write_gguf

    save_random_config(_llama(), tmp_path / "hf")
    # float32 values the 16-bit type holds (the GGUF writer reads the file with numpy,
    # which has no bfloat16)
    _save_in(tmp_path / "hf", dtype, matrices_only=True, stored=torch.float32)
    gguf_path = write_gguf(tmp_path / "hf", tmp_path / "model.gguf", qtype=qtype)
    converted = Path(resolve_model_dir(str(gguf_path), str(tmp_path / "cache")))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the GGUF's vocabulary
        (tmp_path / "hf" / name).write_bytes((converted / name).read_bytes())
    from_file, from_hf = _core(converted), _core(tmp_path / "hf")
    assert "GGUF blocks" in from_file.backends.description
    assert "16-bit weights" in from_hf.backends.description
    kind = qtype.lower()
    assert _packed_kinds(from_file) == _packed_kinds(from_hf) == {kind}
    assert_same_packing(from_file, from_hf)
    prompts = _prompts()
    assert _run(from_file, prompts) == _run(from_hf, prompts)


@needs_avx2
@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_a_bf16_moe_checkpoint_runs_its_experts_on_the_kernels(name: str, tmp_path: Path) -> None:
    """Every expert linear packed as bfloat16 (the routers of 4 and 6 experts are not whole
    8-row groups, nor is Qwen3-MoE's dense layer's 80-column down projection: those stay
    dense), the stacked float32 copies of the experts dropped; greedy tokens those of the
    exact mode, logprobs within float32 sum-order error."""
    from engine.layers.moe import FusedMoE
    from tests.engine.moe_models import CONFIGS

    config = CONFIGS[name]()
    config.head_dim, config.vocab_size = 32, VOCAB
    save_random_config(config, tmp_path)
    _save_in(tmp_path, torch.bfloat16)
    fast, exact = _fast_core(tmp_path, kv_cache_dtype="float32"), _core(tmp_path, dtype="float32")
    assert fast.backends.quantization == "gguf"
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert {m.packed.kind for m in linears if m.packed is not None} == {"bf16"}
    moe = [m for m in fast.model.modules() if isinstance(m, FusedMoE)]
    experts = [linear for m in moe for linear in (*m.gate_up, *m.down)]
    assert experts and all(linear.packed is not None for linear in experts)
    assert all(m.w13.numel() == m.w2.numel() == 0 for m in moe)
    assert all(m.w13.numel() > 0 for m in exact.model.modules() if isinstance(m, FusedMoE))
    prompts = _prompts()
    for (tokens, logprobs), (exact_tokens, exact_logprobs) in zip(
        _run(fast, prompts), _run(exact, prompts), strict=True
    ):
        assert tokens == exact_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, exact_logprobs, strict=True)) < 1e-4


@needs_avx2
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_architecture_on_the_16_bit_path_computes_the_exact_model(
    name: str, tmp_path: Path
) -> None:
    """Every tiny architecture (sliding windows, NoPE layers, q/k norms, GeGLU, partial and
    LongRoPE rotary, fused Phi-3 tensors...) with heads of 32 (the C attention's multiple)
    as a bf16 checkpoint: `auto` puts it on the kernels, and on its 16-bit blocks with
    float32 activations (`gguf`) its greedy tokens and logprobs are the exact mode's up to
    float32 sum order."""
    config = CONFIGS[name]()
    config.vocab_size = VOCAB
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = 32
    rope = getattr(config, "rope_parameters", None) or {}
    for key in ("short_factor", "long_factor"):  # LongRoPE: one factor per rotated pair
        if key in rope:
            rope[key] = [f for f in rope[key] for _ in range(2)]
    save_random_config(config, tmp_path)
    _save_in(tmp_path, torch.bfloat16)
    fast, exact = _fast_core(tmp_path, kv_cache_dtype="float32"), _core(tmp_path, dtype="float32")
    assert fast.backends.quantization == "gguf" and exact.backends.quantization == "none"
    prompts = _prompts()
    for (tokens, logprobs), (exact_tokens, exact_logprobs) in zip(
        _run(fast, prompts), _run(exact, prompts), strict=True
    ):
        assert tokens == exact_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, exact_logprobs, strict=True)) < 1e-4
