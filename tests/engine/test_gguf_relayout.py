"""GGUF formats without a kernel of their own, re-laid as the kernels' blocks
(engine/layers/gguf_relayout.py), checked against gguf-py's dequantizers (llama.cpp's own
reference in Python); and a K-quant file on the CPU fast path end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig

from engine.layers.gguf_relayout import LaidRows, Relayout, as_q8_0, relaid_rows
from tools import kquants


def _weights(rows: int = 8, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Weight-like rows: mostly small, a few outliers, one row all zero, one constant."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    x[1, ::37] *= 20
    x[2] = 0.0
    x[3] = 0.125
    return x


def _deq(kind: str, rows: np.ndarray) -> np.ndarray:
    return dequantize(rows, GT[kind.upper()]).astype(np.float32)


@pytest.mark.parametrize(("kind", "levels"), [("q4_k", 15), ("q5_k", 31), ("q6_k", 63)])
def test_the_test_k_quantizers_write_what_gguf_py_reads(kind: str, levels: int) -> None:
    """The helper's blocks dequantize (by gguf-py) to the input within the format's step."""
    x = _weights()
    rows = getattr(kquants, f"quantize_{kind}")(x)
    got = _deq(kind, rows)
    assert got.shape == x.shape
    spread = np.abs(x).max(axis=1, keepdims=True) * 2
    assert (np.abs(got - x) <= spread / levels + 1e-6).all()
    assert (got[2] == 0).all()


def test_q4_0_is_re_laid_as_q4_1_with_every_value_the_files() -> None:
    x = _weights(cols=256)
    stored = np.asarray(quantize(x, GT.Q4_0))
    kind, rows = relaid_rows("q4_0", stored)
    assert kind == "q4_1" and rows.shape == (8, 256 // 32 * 20)
    assert np.array_equal(_deq("q4_1", rows), _deq("q4_0", stored))


def _q4_k_step_and_offset(stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-column sub-block, the scale d·sc and offset dmin·m a Q4_K row holds."""
    from tests.kernels.relayout_reference import q4_k_scales

    blocks = stored.reshape(stored.shape[0], -1, 144)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = q4_k_scales(blocks[..., 4:16])
    return (d * sc).reshape(stored.shape[0], -1), (dmin * mn).reshape(stored.shape[0], -1)


def test_q4_k_is_re_laid_as_q4_1_with_the_same_nibbles() -> None:
    """Each value moves by at most the float16 rounding of its sub-block's scale and
    offset (2^-11 of each, relative), and by nothing where those are float16 numbers."""
    x = _weights()
    stored = kquants.quantize_q4_k(x)
    kind, rows = relaid_rows("q4_k", stored)
    assert kind == "q4_1" and rows.shape == (8, 512 // 32 * 20)
    want, got = _deq("q4_k", stored), _deq("q4_1", rows)
    step, offset = _q4_k_step_and_offset(stored)
    bound = np.repeat((15 * step + offset) * 2.0**-11, 32, axis=1)
    assert (np.abs(got - want) <= bound).all()
    assert not np.array_equal(got, want)  # the random scales are not float16 numbers

    exact = stored.reshape(8, -1, 144).copy()  # d = dmin = 2^-10: d·sc, dmin·m exact in f16
    exact[..., 0:4] = np.array([2.0**-10, 2.0**-10], np.float16).view(np.uint8)
    exact = exact.reshape(8, -1)
    assert np.array_equal(_deq("q4_1", relaid_rows("q4_k", exact)[1]), _deq("q4_k", exact))


@pytest.mark.parametrize("kind", ["q5_0", "q4_0"])
def test_symmetric_blocks_are_q8_0_blocks_with_every_value_the_files(kind: str) -> None:
    """Q5_0 (and Q4_0, where a layer's other parts need Q8_0): the same float16 scale,
    the integers as int8; zero and negative scales included."""
    x = _weights()
    x[4] *= -1
    stored = np.asarray(quantize(x, GT[kind.upper()]))
    rows = as_q8_0(kind, stored)
    assert rows.shape == (8, 512 // 32 * 34)
    assert np.array_equal(_deq("q8_0", rows), _deq(kind, stored))
    if kind == "q5_0":
        assert relaid_rows(kind, stored)[0] == "q8_0"


@pytest.mark.parametrize("kind", ["q5_1", "q5_k", "q6_k"])
def test_other_formats_are_requantized_to_q8_0_within_half_its_step(kind: str) -> None:
    """Each value within half a Q8_0 step (amax / 254) plus its scale's float16 rounding."""
    x = _weights()
    make = getattr(kquants, f"quantize_{kind}", None)
    stored = make(x) if make else np.asarray(quantize(x, GT[kind.upper()]))
    got_kind, rows = relaid_rows(kind, stored)
    assert got_kind == "q8_0" and rows.shape == (8, 512 // 32 * 34)
    want = _deq(kind, stored)
    amax = np.repeat(np.abs(want.reshape(8, -1, 32)).max(-1), 32, axis=1)
    err = np.abs(_deq("q8_0", rows) - want)
    assert (err <= amax * (1 / 254 + 2.0**-11)).all()  # half a step, the scale's f16 rounding
    assert (_deq("q8_0", rows)[2] == 0).all()


def test_the_kernels_own_kinds_pass_through_untouched() -> None:
    stored = np.asarray(quantize(_weights(), GT.Q4_1))
    kind, rows = relaid_rows("q4_1", stored)
    assert kind == "q4_1" and rows is stored


def test_a_fused_layer_of_mixed_kinds_is_brought_to_q8_0() -> None:
    """Q4_K_M's Q4_K q / k beside a Q6_K v: every part Q8_0, each from its stored rows (a
    Q4_0 part exactly); parts that agree stay as `relaid_rows` lays them; a 16-bit part
    beside blocks is left mixed (the layer stays dense)."""
    x = _weights()
    q4k = ("q4_k", kquants.quantize_q4_k(x))
    q6k = ("q6_k", kquants.quantize_q6_k(x))
    q40 = ("q4_0", np.asarray(quantize(x, GT.Q4_0)))
    laid = LaidRows.of([q4k, q6k, q40])
    assert laid.kind == "q8_0"
    parts = np.split(laid.joined(), 3)
    assert np.array_equal(parts[0], as_q8_0(*q4k))
    assert np.array_equal(parts[1], relaid_rows(*q6k)[1])
    assert np.array_equal(_deq("q8_0", parts[2]), _deq("q4_0", q40[1]))
    same = LaidRows.of([q4k, q4k])
    assert same.kind == "q4_1"
    assert np.array_equal(same.joined(), np.concatenate([relaid_rows(*q4k)[1]] * 2))
    assert LaidRows.of([q4k, ("f16", x.astype(np.float16).view(np.uint8))]) is None


@pytest.mark.parametrize("rows", [8, 12])
def test_a_layer_packs_as_its_re_laid_rows_would_bit_for_bit(rows: int) -> None:
    """`LaidRows.pack` re-lays each part straight into the packed weight (the formats the C
    packer re-lays go as stored, Q5_0 is re-laid first): bitwise the packing of the joined
    re-laid rows, also when a part is not whole groups of 8 rows (12: packed whole)."""
    from kernels.cpu import ops

    if not ops.available():
        pytest.skip("no fast CPU kernels on this host (needs AVX2)")
    x = _weights(rows)
    stored = [
        ("q4_k", kquants.quantize_q4_k(x)),
        ("q6_k", kquants.quantize_q6_k(x * 2)),
        ("q5_0", np.asarray(quantize(x, GT.Q5_0))),
        ("q8_0", np.asarray(quantize(x * 3, GT.Q8_0))),
    ]
    q40 = ("q4_0", np.asarray(quantize(x, GT.Q4_0)))
    for parts in (stored, stored[:2], [stored[0], q40], [stored[0], stored[0]]):
        laid = LaidRows.of(parts)
        got, want = laid.pack(), ops.pack(laid.kind, laid.joined())
        assert (got.kind, got.n, got.k) == (want.kind, want.n, want.k)
        assert torch.equal(got.data, want.data), [k for k, _ in parts]
    assert LaidRows.of(stored).kind == "q8_0" and LaidRows.of([stored[0], q40]).kind == "q4_1"


def test_the_summary_names_what_each_format_became() -> None:
    relayout = Relayout()
    for stored, used in [("q4_k", "q4_1"), ("q4_k", "q4_1"), ("q6_k", "q8_0"), ("q8_0", "q8_0")]:
        relayout.record(stored, used)
    assert relayout.summary() == "Q4_K as Q4_1: 2 tensors, Q6_K as Q8_0: 1 tensor"
    assert Relayout().summary() == ""


# --- a K-quant file on the fast path ------------------------------------------------

VOCAB = 320


def _llama_256() -> LlamaConfig:
    """A Llama whose rows are whole 256-column super-blocks (K-quants need them), head_dim
    32 for the C attention kernel; two layers: a Q4_K_M mix keeps layer 0's attn_v and
    ffn_down in Q6_K and layer 1's in Q4_K (llama.cpp's `use_more_bits`)."""
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        tie_word_embeddings=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.tiny_models import save_random_config

    out = tmp_path_factory.mktemp("llama256")
    save_random_config(_llama_256(), out / "hf")
    return out


def _engines(llama_dir: Path, qtype: str):
    """The file written in `qtype`, converted: its fast-path engine (`gguf`), its exact
    engine (float32 on the file's dequantized weights), and the original checkpoint's."""
    import shutil

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.gguf_convert import convert
    from engine.model_resolver import CONVERSION_MARKER
    from tests.engine.gguf_writer import write_gguf

    path = write_gguf(llama_dir / "hf", llama_dir / f"{qtype}.gguf", qtype=qtype)
    converted = llama_dir / f"{qtype}-converted"
    convert(path, converted)
    (converted / CONVERSION_MARKER).write_text(json.dumps({"source": str(path)}))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the writer's vocabulary
        shutil.copy(converted / name, llama_dir / "hf" / name)
    config = {"max_model_len": 64, "block_size": 4}
    fast = EngineCore(EngineConfig(model=str(converted), quantization="gguf", **config))  # type: ignore[arg-type]
    exact = EngineCore(EngineConfig(model=str(converted), dtype="float32", **config))  # type: ignore[arg-type]
    original = EngineCore(EngineConfig(model=str(llama_dir / "hf"), dtype="float32", **config))  # type: ignore[arg-type]
    return fast, exact, original


def _kl(reference, other, ids: list[int]) -> float:
    """Mean KL(reference || other) of the next-token distributions over one window."""
    from tools.quality import _window_logits

    ref = torch.log_softmax(_window_logits(reference, ids), dim=-1)
    got = torch.log_softmax(_window_logits(other, ids), dim=-1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


@pytest.mark.parametrize(
    ("qtype", "said", "kinds", "exact"),
    [
        ("Q4_K_M", ["Q4_K as Q4_1", "Q6_K as Q8_0", "Q4_K as Q8_0"], {"q4_1", "q8_0"}, False),
        ("Q4_0", ["Q4_0 as Q4_1"], {"q4_1"}, True),
        ("Q5_0", ["Q5_0 as Q8_0"], {"q8_0"}, True),
        ("Q5_K", ["Q5_K as Q8_0"], {"q8_0"}, False),
        ("Q6_K", ["Q6_K as Q8_0"], {"q8_0"}, False),
    ],
)
def test_a_k_quant_gguf_runs_every_linear_on_the_block_kernels(
    llama_dir: Path, qtype: str, said: list[str], kinds: set[str], exact: bool
) -> None:
    """Before re-layout, every tensor of these formats kept a dense float32 weight. Now
    every linear computes from blocks (a Q4_K_M layer with a Q6_K attn_v packs its fused
    q/k/v as Q8_0), the log line says what each format became, the token table is gathered from the file's own rows (until stop
    46 requantized to Q8_0), and the re-laid model is the file's own: teacher-forced KL from the
    exact mode (the file's dequantized weights) ~0 where the re-layout is exact (Q4_0,
    Q5_0), else at most 1/8 of the KL the file's quantization put between the original
    checkpoint and that exact mode (this random model is far more sensitive than a trained
    one; tools.quality measures SmolLM2)."""
    from engine.layers.gguf_linear import GGUFBlockLinearMethod
    from engine.layers.linear import Linear
    from kernels.cpu import ops

    if not ops.available():
        pytest.skip("host has no AVX2: the fast path does not run here")
    fast, dequantized, original = _engines(llama_dir, qtype)
    assert fast.backends.quantization == "gguf"
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, GGUFBlockLinearMethod) for m in linears)
    assert {m.packed.kind for m in linears} == kinds
    for text in said:
        assert text in fast.backends.description
    from engine.layers.gguf_linear import GGUFSource

    stored = GGUFSource(llama_dir / f"{qtype}.gguf").raw("token_embd.weight")[0]
    assert f"token table as its {stored.upper()} rows" in fast.backends.description
    table = fast.model.model.embed_tokens
    assert table.weight.dtype == torch.uint8 and table.blocks == stored
    assert _mapped_file(table.weight.data_ptr()) == str(llama_dir / f"{qtype}.gguf")
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    relaid, quantized = _kl(dequantized, fast, ids), _kl(original, dequantized, ids)
    if exact:  # the file's own values: only the order of float32 sums differs
        assert abs(relaid) < 1e-6, relaid
    else:
        assert 0 < relaid <= quantized / 8, (relaid, quantized)


def _mapped_file(address: int) -> str | None:
    """The file this process has mapped at `address` (/proc/self/maps), or None (anonymous
    memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in span.split("-"))
        if low <= address < high:
            return rest[4] if len(rest) == 5 else None
    return None


def test_a_16_bit_token_table_is_gathered_as_stored(llama_dir: Path) -> None:
    """An F16 file's token table stays float16 (the gather widens it exactly), and rows
    gathered equal the exact mode's."""
    from kernels.cpu import ops

    if not ops.available():
        pytest.skip("host has no AVX2: the fast path does not run here")
    fast, exact, _ = _engines(llama_dir, "F16")
    table = fast.model.model.embed_tokens.weight
    assert table.dtype == torch.float16
    assert _mapped_file(table.data_ptr()) == str(llama_dir / "F16.gguf")  # the file's rows
    ids = torch.tensor([0, 7, VOCAB - 1])
    want = exact.model.model.embed_tokens.weight[ids]
    assert torch.equal(ops.embedding(ids, table), want)
